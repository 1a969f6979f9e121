"""Servers that sample with one seed are named by the router: vLLM draws a request without a
seed of its own from the generator its server's ``--seed`` started, so two servers seeded alike
and handed alike batches return alike samples. ``up`` seeds its servers apart
(``servers.fleet.seeds``); servers started by hand may not be. Stand-in backends that report
their seeds; the subject is the router, and the routing view of a client routing itself
(``trainer_client.direct``), which says the same where a trainer reads it."""

from __future__ import annotations

import logging

import grpc
import pytest

from servers.router.fleet_view import FleetEvents, fleet_view
from servers.router.router_server import RouterOptions, RouterServer
from tests.helpers.fake_backend import FakeBackend
from tests.helpers.waits import until
from trainer_client.direct import DirectRoutes


async def test_the_router_and_a_client_routing_itself_warn_of_servers_sharing_a_seed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backends = [await FakeBackend(name, status=True).start() for name in ("a", "b", "c")]
    a, b, c = backends
    for backend, seed in ((a, 0), (b, 1)):
        assert backend.status is not None
        backend.status.sampling_seed = seed
    router = RouterServer(
        RouterOptions(backends=[x.address for x in backends], health_check_interval=0.1)
    )
    caplog.set_level(logging.WARNING, logger="servers.router.backends")
    caplog.set_level(logging.WARNING, logger="trainer_client.direct")
    routes: DirectRoutes | None = None
    channel: grpc.aio.Channel | None = None
    try:
        await router.start()
        await router.wait_healthy(3)
        channel = grpc.aio.insecure_channel(router.address)
        routes = DirectRoutes(channel, (), lambda address, session: None)
        assert await routes.ready()

        def seeds() -> dict[str, int | None]:
            view = fleet_view(router.pool, FleetEvents(), None)
            return {s["address"]: s["sampling_seed"] for s in view["servers"]}

        await until(lambda: seeds()[b.address] == 1, what="the router to follow b's seed")
        await until(lambda: seeds()[a.address] == 0, what="the router to follow a's seed")
        assert seeds()[c.address] is None  # c reports none (an older server): nothing to say
        assert not [r for r in caplog.records if "seed" in r.getMessage()]  # 0 and 1 differ
        assert c.status is not None
        c.status.sampling_seed = 0  # c now samples as a does
        c.set_version(1)  # reported at once
        await until(
            lambda: any("seed 0" in r.getMessage() for r in caplog.records),
            what="a warning that c samples as a does",
        )
        (warning,) = [r.getMessage() for r in records(caplog, "servers.router.backends")]
        assert c.address in warning and a.address in warning and b.address not in warning
        assert "--seed" in warning
        # The client follows the seeds in the router's view and says it once, in its own log.
        await until(
            lambda: bool(records(caplog, "trainer_client.direct")), what="the client's warning"
        )
        for _ in range(3):  # more views come: nothing new to say
            c.set_version(c.servicer.weight_version + 1)
            await until(
                lambda: routes.members[c.address].weight_version == c.servicer.weight_version
            )
        (said,) = [r.getMessage() for r in records(caplog, "trainer_client.direct")]
        assert f"{a.address}, {c.address}" in said or f"{c.address}, {a.address}" in said
        assert b.address not in said and "seed 0" in said
        assert {m.address: m.sampling_seed for m in routes.members.values()} == {
            a.address: 0,
            b.address: 1,
            c.address: 0,
        }
    finally:
        if routes is not None:
            await routes.close()
        if channel is not None:
            await channel.close()
        await router.stop(0)
        for backend in backends:
            await backend.stop()


def records(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    """The warnings of ``logger`` about seeds."""
    return [r for r in caplog.records if r.name == logger and "seed" in r.getMessage()]
