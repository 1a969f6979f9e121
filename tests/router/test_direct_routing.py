"""Direct routing: the trainer client follows the router's view (RouterAdmin.WatchBackends)
and sends generations straight to the server the router's policy picks, against real engine
servers (tiny model)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import grpc
import pytest

from servers.router.router_server import RouterOptions, RouterServer
from skyrl_grpc.names import GENERATE_STREAM
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from tests.helpers.sessions import end_every_session, routed_to
from tests.helpers.waits import until
from trainer_client import InferenceClient

pytestmark = pytest.mark.engine
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def holders(servers: list[Any], session: str) -> set[str]:
    """The servers holding ``session`` (their own record of sessions they served)."""
    return {s.address for s in servers if session in s.state.started.sessions.snapshot()}


def live(servers: list[Any]) -> dict[str, int]:
    """Live sessions per server, as the servers themselves count them."""
    return {s.address: len(s.state.started.sessions.snapshot()) for s in servers}


async def placed_by(router: str, session: str) -> str:
    """Where the router at ``router`` sends ``session``."""
    async with grpc.aio.insecure_channel(router) as channel:
        return await routed_to(channel, session)


def forwarded(router: RouterServer) -> float:
    return sum(
        router.metrics.registry.get_sample_value(
            "skyrl_router_processed_requests_total",
            {"method": GENERATE_STREAM, "worker": b.address},
        )
        or 0.0
        for b in router.pool.backends
    )


async def fresh_router(backends: list[str], port: int = 0) -> RouterServer:
    router = RouterServer(RouterOptions(backends=backends, port=port, health_check_interval=0.1))
    await router.start()
    await router.wait_healthy(len(backends))
    return router


async def test_sessions_land_on_the_same_servers_through_the_router_and_directly(
    engine_server: Any, second_engine_server: Any
) -> None:
    servers = [engine_server, second_engine_server]
    await end_every_session(servers)  # what earlier tests left would end by idleness meanwhile
    router = await fresh_router([s.address for s in servers])
    client = InferenceClient(router.address, [s.address for s in servers])
    try:
        before = forwarded(router)
        # The router learns from the servers' reports that none are left (a Counter: zeros
        # and absent servers compare equal).
        await until(
            lambda: router.pool.placement.sessions.live_sessions() == Counter(live(servers))
        )
        held_before = live(servers)
        direct = [f"direct-{i}" for i in range(6)]
        await client.generate_batch([[1, 2, 3]] * 6, GREEDY, session_ids=direct)
        assert forwarded(router) == before  # nothing went through the router
        for session in direct:
            (home,) = holders(servers, session)
            await until(
                lambda s=session: router.pool.placement.sessions.home(s) is not None  # type: ignore[misc]
            )
            assert await placed_by(router.address, session) == home
        # Each new session went to the server with the fewest live sessions: the gap narrowed
        # by every placement, or to one where six could not close it.
        gap_before = abs(held_before[servers[0].address] - held_before[servers[1].address])
        after = live(servers)
        assert abs(after[servers[0].address] - after[servers[1].address]) == max(
            gap_before - 6, (gap_before - 6) % 2
        ), (held_before, after)
        # And the other way round: placed by the router first, then followed by the client.
        via_router = [f"router-{i}" for i in range(6)]
        homes = {s: await placed_by(router.address, s) for s in via_router}
        routes = client.connections.routes()
        await until(lambda: all(routes.pick(s) is not None for s in via_router))
        await until(
            lambda: all(
                routes.policy is not None and routes.policy.sessions.home(s) == homes[s]
                for s in via_router
            ),
            what="the client's view to show the router's placements",
        )
        await client.generate_batch([[1, 2, 3]] * 6, GREEDY, session_ids=via_router)
        assert all(holders(servers, s) == {homes[s]} for s in via_router)
        for session in direct + via_router:
            await client.finish_session(session)
    finally:
        await client.close()
        await router.stop(0)


async def test_a_backend_added_to_the_router_gets_new_sessions_on_both_paths(
    engine_server: Any, second_engine_server: Any
) -> None:
    router = await fresh_router([engine_server.address])
    client = InferenceClient(router.address, [engine_server.address, second_engine_server.address])
    try:
        old = [f"before-join-{i}" for i in range(3)]
        await client.generate_batch([[1, 2]] * 3, GREEDY, session_ids=old)
        routes = client.connections.routes()
        async with grpc.aio.insecure_channel(router.address) as channel:
            await router_pb2_grpc.RouterAdminStub(channel).AddBackend(
                router_pb2.AddBackendRequest(address=second_engine_server.address)
            )
        await router.wait_healthy(2)
        await until(
            lambda: (
                (member := routes.members.get(second_engine_server.address)) is not None
                and member.eligible
            ),
            what="the feed to show the new backend healthy",
        )
        direct = await client.generate([1, 2], GREEDY, session_id="after-join-direct")
        assert direct.token_ids
        assert holders([engine_server, second_engine_server], "after-join-direct") == {
            second_engine_server.address
        }
        assert await placed_by(router.address, "after-join-router") == second_engine_server.address
        for session in [*old, "after-join-direct", "after-join-router"]:
            await client.finish_session(session)
    finally:
        await client.close()
        await router.stop(0)


async def test_the_client_keeps_serving_while_the_router_is_down_and_reconnects(
    engine_server: Any, second_engine_server: Any
) -> None:
    from skyrl_grpc.process_group import free_port

    port = free_port("127.0.0.1")
    backends = [engine_server.address, second_engine_server.address]
    router = await fresh_router(backends, port)
    client = InferenceClient(router.address, backends)
    try:
        first = await client.generate([1, 5, 9], GREEDY, session_id="outage")
        routes = client.connections.routes()
        assert routes.connected
        await router.stop(0)
        await until(lambda: not routes.connected, what="the client to notice the router left")
        during = await client.generate([1, 5, 9], GREEDY, session_id="outage")
        assert during.token_ids == first.token_ids  # served directly from the last view
        router = await fresh_router(backends, port)
        await until(lambda: routes.connected, what="the feed to reconnect")
        after = await client.generate([1, 5, 9], GREEDY, session_id="outage")
        assert after.token_ids == first.token_ids
        await client.finish_session("outage")
    finally:
        await client.close()
        await router.stop(0)


async def test_without_a_view_calls_go_through_the_router(engine_server: Any) -> None:
    # An engine server stands in for a router that has no WatchBackends (UNIMPLEMENTED).
    client = InferenceClient(engine_server.address, [engine_server.address])
    result = await client.generate([1, 2, 3], GREEDY)
    assert len(result.token_ids) == 8
    assert not await client.connections.routes().ready()
    await client.close()


async def test_a_client_started_while_the_router_is_down_routes_from_the_servers_status(
    engine_server: Any, second_engine_server: Any
) -> None:
    """No router ever reached: the client builds its view from the servers it was given (their
    ServerStatus), spreads new sessions over both, keeps each on its server, and hands over to
    the router's view once a router comes up at the address."""
    from skyrl_grpc.process_group import free_port

    servers = [engine_server, second_engine_server]
    await end_every_session(servers)
    port = free_port("127.0.0.1")
    backends = [engine_server.address, second_engine_server.address]
    client = InferenceClient(f"127.0.0.1:{port}", backends)
    sessions = [f"no-router-{i}" for i in range(8)]
    prompts = [[1, 40 + i, 9] for i in range(len(sessions))]
    router = None
    try:
        first = await client.generate_batch(prompts, GREEDY, session_ids=sessions)
        assert [len(r.token_ids) for r in first] == [8] * len(sessions)
        routes = client.connections.routes()
        assert routes.from_servers and not routes.connected
        homes = {s: holders(servers, s) for s in sessions}
        assert all(len(h) == 1 for h in homes.values()), homes
        assert all(n > 0 for n in live(servers).values()), live(servers)  # both took some
        again = await client.generate_batch(prompts, GREEDY, session_ids=sessions)
        assert [r.token_ids for r in again] == [r.token_ids for r in first]
        assert {s: holders(servers, s) for s in sessions} == homes  # each stayed home
        router = await fresh_router(backends, port)
        await until(lambda: routes.connected, what="the router's feed")
        assert not routes.from_servers
        for session in sessions[:2]:
            await client.generate([1, 5, 9], GREEDY, session_id=session)
            assert holders(servers, session) == homes[session]
    finally:
        await client.close()
        if router is not None:
            await router.stop(0)
        await end_every_session(servers)
