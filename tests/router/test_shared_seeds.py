"""Servers that sample with one seed are named by the router: vLLM draws a request without a
seed of its own from the generator its server's ``--seed`` started, so two servers seeded alike
and handed alike batches return alike samples. ``up`` seeds its servers apart
(``servers.fleet.seeds``); servers started by hand may not be. Stand-in backends that report
their seeds; the subject is the router."""

from __future__ import annotations

import logging

import pytest

from servers.router.fleet_view import FleetEvents, fleet_view
from servers.router.router_server import RouterOptions, RouterServer
from tests.helpers.fake_backend import FakeBackend
from tests.helpers.waits import until


async def test_the_router_warns_of_servers_sharing_a_sampling_seed_and_shows_each_seed(
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
    try:
        await router.start()
        await router.wait_healthy(3)

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
        (warning,) = [r.getMessage() for r in caplog.records if "seed" in r.getMessage()]
        assert c.address in warning and a.address in warning and b.address not in warning
        assert "--seed" in warning
    finally:
        await router.stop(0)
        for backend in backends:
            await backend.stop()
