"""Warm standbys at the router and on the direct path (stand-in backends: the routing rule is
the subject): a standby is a member that gets no data-plane call, until SetStandby makes it
serving; a client routing itself skips it too, and its control calls reach it while it is
healthy."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest

from servers.router.router_server import RouterOptions, RouterServer
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from tests.helpers.fake_backend import FakeBackend
from tests.helpers.waits import until
from tests.router.test_router import routed_stream
from trainer_client.direct import DirectRoutes


async def start(backends: list[FakeBackend], standbys: list[FakeBackend]) -> RouterServer:
    options = RouterOptions(
        backends=[b.address for b in backends],
        standbys=[b.address for b in standbys],
        health_check_interval=0.1,
    )
    router = RouterServer(options)
    await router.start()
    await router.wait_healthy(len(backends) + len(standbys))
    return router


# Two serving stand-ins, a standby, and a router over them.
Fleet = tuple[FakeBackend, FakeBackend, FakeBackend, RouterServer]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    a, b, spare = [await FakeBackend(name).start() for name in ("a", "b", "spare")]
    router = await start([a, b], [spare])
    yield a, b, spare, router
    await router.stop(0)
    for backend in (a, b, spare):
        await backend.stop()


async def spread(channel: grpc.aio.Channel, calls: int = 24) -> Counter[str]:
    """Where ``calls`` streams went: half with a session each, half without."""
    went: Counter[str] = Counter()
    for i in range(calls):
        address, _ = await routed_stream(channel, f"standby-s{i}" if i % 2 else None)
        went[address] += 1
    return went


async def test_a_standby_gets_no_call_until_made_serving_and_one_made_standby_stops(
    fleet: Fleet,
) -> None:
    a, b, spare, router = fleet
    async with grpc.aio.insecure_channel(router.address) as channel:
        admin = router_pb2_grpc.RouterAdminStub(channel)
        listed = await admin.ListBackends(router_pb2.ListBackendsRequest())
        roles = {m.address: (m.standby, m.state) for m in listed.backends}
        healthy = router_pb2.BACKEND_STATE_HEALTHY
        assert roles == {a.address: (False, healthy), b.address: (False, healthy),
                         spare.address: (True, healthy)}  # fmt: skip
        assert spare.address not in await spread(channel)
        assert spare.observed.calls == 0

        promoted = await admin.SetStandby(
            router_pb2.SetStandbyRequest(address=spare.address, standby=False)
        )
        assert not promoted.backend.standby
        await admin.SetStandby(router_pb2.SetStandbyRequest(address=a.address, standby=True))
        calls_on_a = a.observed.calls
        went = await spread(channel)
        assert a.address not in went and went[spare.address] > 0, went
        assert a.observed.calls == calls_on_a
        kinds = [event["kind"] for event in router.proxy.events.recent()]
        assert "promoted" in kinds and "standby" in kinds

        # A fleet of standbys only serves nothing: the router says so.
        for member in (b, spare):
            request = router_pb2.SetStandbyRequest(address=member.address, standby=True)
            await admin.SetStandby(request)
        try:
            await routed_stream(channel)
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "standby" in (error.details() or ""), error.details()
        else:
            raise AssertionError("a call went to a standby")
        missing = router_pb2.SetStandbyRequest(address="127.0.0.1:1", standby=True)
        try:
            await admin.SetStandby(missing)
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND
        else:
            raise AssertionError("SetStandby of an unknown backend succeeded")


async def test_the_router_puts_a_standby_in_a_lost_servers_place_before_any_call_fails(
    fleet: Fleet,
) -> None:
    a, b, spare, router = fleet
    async with grpc.aio.insecure_channel(router.address) as channel:
        await a.stop()  # killed: its connection drops

        async def swapped() -> bool:
            roles = {m.address: m.standby for m in router.pool.backends}
            return roles == {a.address: True, b.address: False, spare.address: False}

        await until(swapped, what="the standby promoted in the lost server's place")
        went = await spread(channel)
        assert set(went) == {b.address, spare.address}, went
        # Lost again: no standby is ready (the lost one is down), so nobody is promoted.
        await spare.stop()
        await until(lambda: not router.pool.get(spare.address).healthy, what="spare lost")
        assert not router.pool.get(spare.address).standby
        assert set(await spread(channel, 6)) == {b.address}


async def test_a_client_routing_itself_skips_standbys_and_reaches_them_only_while_healthy(
    fleet: Fleet,
) -> None:
    a, b, spare, router = fleet
    async with grpc.aio.insecure_channel(router.address) as channel:
        routes = DirectRoutes(channel, (), lambda address, session: None)
        assert await routes.ready()
        picked = {routes.pick(f"s{i}") for i in range(40)} | {routes.pick(None)}
        assert picked == {a.address, b.address}
        everyone = [a.address, b.address, spare.address]
        assert await routes.fleet_now(everyone) == everyone
        # Given only the serving servers, it still follows the fleet, standbys too.
        assert await routes.fleet_now([a.address, b.address]) == everyone
        # A standby that is down or starting is not waited for by control calls.
        await spare.set_serving(False)

        async def spare_left_out() -> bool:
            return await routes.fleet_now(everyone) == [a.address, b.address]

        await until(spare_left_out, what="a standby that is not healthy left out")
        await routes.close()
