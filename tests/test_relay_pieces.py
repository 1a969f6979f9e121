"""The relay's pieces without engines: the trainer's relay plan (trees per variant, a chain on
each host before hosts fan out), the servers' rule for who may stream into an update, and the
one path every weight stream is read through (forwarded before it is staged, the rest still
forwarded when staging refuses it, cut below when it is cut above)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from servers.engine.domain.weights.relay_role import (
    RelayRole,
    RelayTarget,
    check_sender,
    forwards,
)
from servers.engine.peers.peer_streams import Failure, Item, stage_stream
from skyrl_grpc.errors import InvalidArgument, PermissionDenied
from trainer_client.weights.relay_plan import relay_for, relay_plan
from trainer_client.weights.update_plan import (
    PushedWeights,
    Sending,
    ServerState,
    UpdatePlan,
)


def test_servers_on_one_host_relay_in_a_chain_in_the_fleets_order() -> None:
    plan = relay_plan([["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]], fanout=2)
    assert plan.roots == ["127.0.0.1:1"]
    assert plan.children == {"127.0.0.1:1": ("127.0.0.1:2",), "127.0.0.1:2": ("127.0.0.1:3",)}
    assert plan.subtree("127.0.0.1:1") == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    assert len(set(plan.tickets.values())) == 3
    assert all(len(ticket) == 16 for ticket in plan.tickets.values())


def test_hosts_fan_out_and_each_host_relays_to_its_own_servers_first() -> None:
    servers = [f"10.0.0.{host}:{port}" for host in range(1, 6) for port in (1, 2)]
    plan = relay_plan([servers], fanout=2)
    assert plan.roots == ["10.0.0.1:1"]
    # The root's own host first, then two other hosts' first servers.
    assert plan.children["10.0.0.1:1"] == ("10.0.0.1:2", "10.0.0.2:1", "10.0.0.3:1")
    assert plan.children["10.0.0.2:1"] == ("10.0.0.2:2", "10.0.0.4:1", "10.0.0.5:1")
    assert plan.children["10.0.0.3:1"] == ("10.0.0.3:2",)
    assert sorted(plan.subtree("10.0.0.1:1")) == sorted(servers)
    chain = relay_plan([servers], fanout=1)
    assert chain.children["10.0.0.1:1"] == ("10.0.0.1:2", "10.0.0.2:1")
    assert chain.children["10.0.0.4:1"] == ("10.0.0.4:2", "10.0.0.5:1")
    with pytest.raises(ValueError, match="fan-out 0"):
        relay_plan([servers], fanout=0)


def test_each_variant_of_an_update_gets_a_tree_and_old_servers_are_streamed_to_directly() -> None:
    servers = ("h:1", "h:2", "h:3", "h:4", "h:5")
    plan = UpdatePlan(
        servers=servers,
        version=8,
        collective=False,
        base=PushedWeights(7, {}),
        serving={"h:1": 7, "h:2": 6, "h:3": 7, "h:4": 6, "h:5": 7},
        compressing=frozenset(),
        sending=Sending(1, 1, False, 1.0),
    )
    states = {a: ServerState(plan.serving[a], True, relays=a != "h:5") for a in servers}
    relay = relay_for(plan, states, fanout=1)
    assert relay is not None
    assert relay.roots == ["h:1", "h:2"]  # the patches' tree, the whole weights' tree
    assert relay.subtree("h:1") == ["h:1", "h:3"] and relay.subtree("h:2") == ["h:2", "h:4"]
    assert not relay.relays("h:5")  # an older server: the trainer streams to it
    assert relay_for(plan, states, fanout=0) is None
    assert relay_for(plan, {"h:1": states["h:1"]}, fanout=1) is None


def test_only_the_trainer_and_the_named_parent_stream_into_an_update() -> None:
    role = RelayRole("b:1", "a:1", (RelayTarget("c:1", 0, b"t" * 16),))
    check_sender(role, "a:1")
    check_sender(role, "")  # the trainer, e.g. the whole weights after a refused patch
    check_sender(None, "")
    with pytest.raises(PermissionDenied, match="does not name"):
        check_sender(role, "x:9")
    with pytest.raises(PermissionDenied, match="no relay plan"):
        check_sender(None, "a:1")
    assert forwards(role, "a:1") and not forwards(role, "")
    root = RelayRole("a:1", "", (RelayTarget("b:1", 0, b"t" * 16),))
    assert forwards(root, "") and not forwards(RelayRole("c:1", "b:1"), "b:1")


class Recorder:
    """A ``Forwarding`` that records what it forwards and how the stream ended."""

    def __init__(self, below: list[Failure] | None = None) -> None:
        self.forwarded: list[bytes] = []
        self.ended = ""
        self._below = below or []

    async def forward(self, raw: bytes | memoryview) -> None:
        self.forwarded.append(bytes(raw))

    async def finish(self) -> list[Failure]:
        self.ended = "finished"
        return self._below

    def abort(self) -> None:
        self.ended = "aborted"


def messages(count: int, cut_after: int | None = None) -> AsyncIterator[tuple[bytes, Item]]:
    async def each() -> AsyncIterator[tuple[bytes, Item]]:
        for index in range(count):
            if index == cut_after:
                raise ConnectionError("the sender went away")
            yield f"m{index}".encode(), index  # type: ignore[misc]

    return each()


async def test_a_stream_is_forwarded_before_this_server_stages_each_message() -> None:
    recorder = Recorder()
    seen: list[tuple[int, int]] = []

    async def push(items: AsyncIterator[Item]) -> tuple[int, int]:
        async for item in items:
            seen.append((item, len(recorder.forwarded)))  # type: ignore[arg-type]
        return 3, 30

    outcome = await stage_stream(messages(3), push, recorder)
    assert seen == [(0, 1), (1, 2), (2, 3)]  # each message forwarded before it was seen
    assert (outcome.staged, outcome.received, outcome.error) == (3, 30, None)
    assert recorder.ended == "finished"


async def test_a_refused_stream_still_reaches_the_servers_below_whole() -> None:
    below = [Failure("c:1", grpc.StatusCode.DATA_LOSS, "bad chunk")]
    recorder = Recorder(below)

    async def refuse(items: AsyncIterator[Item]) -> tuple[int, int]:
        async for _ in items:
            raise InvalidArgument("not this server's shapes")
        return 0, 0

    outcome = await stage_stream(messages(4), refuse, recorder)
    assert isinstance(outcome.error, InvalidArgument)
    assert recorder.forwarded == [b"m0", b"m1", b"m2", b"m3"] and recorder.ended == "finished"
    assert outcome.below == below
    # Without forwarding, the rest is left for the caller to drop.
    alone = await stage_stream(messages(4), refuse)
    assert isinstance(alone.error, InvalidArgument)


async def test_a_stream_cut_above_is_cut_below() -> None:
    recorder = Recorder()

    async def stage(items: AsyncIterator[Item]) -> tuple[int, int]:
        async for _ in items:
            pass
        return 2, 20

    with pytest.raises(ConnectionError):
        await stage_stream(messages(5, cut_after=2), stage, recorder)
    assert recorder.forwarded == [b"m0", b"m1"] and recorder.ended == "aborted"
