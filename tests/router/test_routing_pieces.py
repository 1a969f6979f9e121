"""Small pieces of routing and fan-out on their own (no engine, no server): the client's view
of the router's feed (``DirectRoutes.apply``), status announcements, and fan-out outcomes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from servers.engine.service.status import StatusChanges
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from tests.helpers.streams import unused_address
from trainer_client.direct import DirectRoutes
from trainer_client.exceptions import FanOutError, NotFound, ServerError
from trainer_client.fanout import failures_of, fan_out

HEALTHY, UNHEALTHY = router_pb2.BACKEND_STATE_HEALTHY, router_pb2.BACKEND_STATE_UNHEALTHY


@pytest.fixture
async def routes_and_moves() -> AsyncIterator[tuple[DirectRoutes, list[tuple[str, str]]]]:
    """A routing view fed by hand (its router is unreachable); the moves it reports."""
    moves: list[tuple[str, str]] = []
    channel = grpc.aio.insecure_channel(unused_address())
    routes = DirectRoutes(channel, (), lambda address, session: moves.append((address, session)))
    yield routes, moves
    await routes.close()
    await channel.close()


def _view(
    states: dict[str, router_pb2.BackendState],
    sessions: dict[str, str],
    complete: bool = True,
    removed: tuple[str, ...] = (),
) -> router_pb2.WatchBackendsResponse:
    return router_pb2.WatchBackendsResponse(
        placement="bounded-load",
        backends=[router_pb2.Backend(address=a, state=s) for a, s in states.items()],
        complete=complete,
        sessions_added=[
            router_pb2.SessionPlacement(session_id=s, address=a) for s, a in sessions.items()
        ],
        sessions_removed=list(removed),
    )


async def test_the_view_places_sessions_where_the_feed_says(
    routes_and_moves: tuple[DirectRoutes, list[tuple[str, str]]],
) -> None:
    routes, moves = routes_and_moves
    routes.apply(_view({"a": HEALTHY, "b": HEALTHY}, {"s1": "a", "s2": "b"}))
    assert await routes.ready()
    assert (routes.pick("s1"), routes.pick("s2")) == ("a", "b")
    # The router moved s1 (a change message): this client follows.
    routes.apply(_view({"a": HEALTHY, "b": HEALTHY}, {"s1": "b"}, complete=False))
    assert routes.pick("s1") == "b"
    assert moves == []  # the router moved it and tells the server itself
    # A server gone unhealthy gets nothing; its sessions move, and the server is told.
    routes.apply(_view({"a": HEALTHY, "b": UNHEALTHY}, {}, complete=False))
    assert routes.pick(None) == "a" and routes.pick("s2") == "a"
    assert moves == [("b", "s2")]


async def test_the_fleet_now_keeps_the_given_order_and_adds_new_servers_after_it(
    routes_and_moves: tuple[DirectRoutes, list[tuple[str, str]]],
) -> None:
    """Control calls follow the router's membership, in the order the client was given (a
    collective group's rank offsets follow it), whatever order the router lists them in."""
    routes, _ = routes_and_moves
    routes.first_members = frozenset({"b", "a"})  # what the feed sets on its first view
    routes.apply(_view({"b": HEALTHY, "a": HEALTHY}, {}))
    assert await routes.fleet_now(["a", "b"]) == ["a", "b"]
    assert await routes.fleet_now(["b", "a"]) == ["b", "a"]
    # a moved to c (restarted elsewhere) and d joined: the kept keep their place.
    routes.apply(_view({"d": HEALTHY, "c": HEALTHY, "b": HEALTHY}, {}))
    assert await routes.fleet_now(["a", "b"]) == ["b", "c", "d"]
    # A client given only some of the servers keeps to those.
    assert await routes.fleet_now(["b"]) is None


class _ListingRouter(router_pb2_grpc.RouterAdminServicer):
    """A router that lists the members it is told to (its feed is not served)."""

    def __init__(self, members: list[str]) -> None:
        self.members = members

    async def ListBackends(
        self,
        request: router_pb2.ListBackendsRequest,
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> router_pb2.ListBackendsResponse:
        return router_pb2.ListBackendsResponse(
            backends=[router_pb2.Backend(address=a, state=HEALTHY) for a in self.members]
        )


async def test_the_fleet_now_is_the_routers_membership_at_the_call_not_a_lagging_feeds() -> None:
    """The feed lags while it reconnects (the router restarted): a fleet-wide call planned on
    that view missed a server that had joined, and a weight update "committed" with it left
    at the old version (seen in CI: a node left, its server came back elsewhere)."""
    router = grpc.aio.server()
    listing = _ListingRouter(["b", "c"])  # type: ignore[abstract]  # serves ListBackends only
    router_pb2_grpc.add_RouterAdminServicer_to_server(listing, router)
    port = router.add_insecure_port("127.0.0.1:0")
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    routes = DirectRoutes(channel, (), lambda address, session: None)
    try:
        routes.first_members = frozenset({"a", "b"})
        routes.apply(_view({"a": HEALTHY, "b": HEALTHY}, {}))  # the last view the feed gave
        assert await routes.fleet_now(["a", "b"]) == ["b", "c"]
        # The router gone: its last view decides (a trainer keeps working while it restarts).
        await router.stop(None)
        assert await routes.fleet_now(["a", "b"]) == ["a", "b"]
    finally:
        await routes.close()
        await channel.close()
        await router.stop(None)


async def test_a_server_that_failed_is_skipped_for_a_while_and_tried_ones_are_not_picked(
    routes_and_moves: tuple[DirectRoutes, list[tuple[str, str]]],
) -> None:
    routes, _ = routes_and_moves
    routes.apply(_view({"a": HEALTHY, "b": HEALTHY}, {}))
    routes.mark_unavailable("a")
    assert {routes.pick(None) for _ in range(5)} == {"b"}
    assert routes.pick(None, tried=["b"]) is None
    # A continuation of tokens made at version 2 goes through the router (held there for a
    # server that new) rather than to "b", the only one left, serving 1.
    view = _view({"b": HEALTHY}, {})
    view.backends[0].weight_version = 1
    routes.apply(view)
    assert routes.members["b"].weight_version == 1
    assert routes.pick(None, min_version=2) is None and routes.pick(None, min_version=1) == "b"
    # A member the feed no longer lists is gone from the view.
    routes.apply(_view({"b": HEALTHY}, {}))
    assert set(routes.members) == {"b"}


async def test_status_watchers_wake_at_an_announcement_or_their_timeout() -> None:
    """A watcher sleeps through its whole timeout unless a change is announced; one is woken
    by the announcement at once (its 30 s timeout never in play); one with nothing announced
    returns at its own short timeout."""
    changes = StatusChanges()
    waiting = asyncio.ensure_future(changes.wait(timeout=30))
    done, _ = await asyncio.wait([waiting], timeout=0.2)
    assert not done, "a watcher woke with nothing announced"
    changes.announce()
    await asyncio.wait_for(waiting, 10)  # woken: far inside its own 30 s
    quiet = asyncio.ensure_future(changes.wait(timeout=0.05))  # nothing announced
    await asyncio.wait_for(quiet, 10)


async def test_fan_out_keeps_each_servers_outcome() -> None:
    async def call(address: str) -> int:
        if address == "bad":
            raise ServerError.of(address, grpc.StatusCode.NOT_FOUND, "no such adapter")
        return len(address)

    assert await fan_out("Op", ["a", "bb"], call) == {"a": 1, "bb": 2}
    with pytest.raises(FanOutError) as raised:
        await fan_out("Op", ["a", "bad"], call)
    assert raised.value.results == {"a": 1} and isinstance(raised.value.failures["bad"], NotFound)
    with pytest.raises(ValueError, match="no server addresses"):
        await fan_out("Op", [], call)
    failures = await failures_of(["a", "bad"], call)
    assert list(failures) == ["bad"]

    async def bug(address: str) -> int:
        raise KeyError(address)  # not a server's answer: a bug, raised as is

    with pytest.raises(KeyError):
        await fan_out("Op", ["a"], bug)
