"""The relay's pieces without engines: the trainer's relay plan (trees per variant, each host
forwarding in one tree, a chain on each host before hosts fan out, shares by bytes), the servers' rule for who may stream into an update, and the
one path every weight stream is read through (forwarded before it is staged, the rest still
forwarded when staging refuses it, cut below when it is cut above)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from servers.engine.domain.weights.relay_role import (
    RelayRole,
    RelayTarget,
    RelayTree,
    check_sender,
    forwarded_tree,
)
from servers.engine.peers.peer_streams import Failure, Item, stage_stream
from skyrl_grpc.errors import InvalidArgument, PermissionDenied
from trainer_client.weights.relay_plan import (
    FAST_STREAM_BYTES_PER_SECOND,
    PACE_MIN_BYTES,
    RelayPace,
    fanout_for,
    relay_for,
    relay_plan,
)
from trainer_client.weights.relay_plan import RelayTree as PlanTree
from trainer_client.weights.update_plan import (
    PushedWeights,
    Sending,
    ServerState,
    UpdatePlan,
)
from trainer_client.weights.update_shares import split_shares


def test_servers_on_one_host_relay_in_a_chain_in_the_fleets_order() -> None:
    plan = relay_plan([["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]], fanout=2)
    (tree,) = plan.trees_of("127.0.0.1:1")  # one host: one tree, whatever the fan-out
    assert tree.root == "127.0.0.1:1"
    assert tree.children == {"127.0.0.1:1": ("127.0.0.1:2",), "127.0.0.1:2": ("127.0.0.1:3",)}
    assert tree.subtree("127.0.0.1:1") == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    assert len(set(plan.tickets.values())) == 3
    assert all(len(ticket) == 16 for ticket in plan.tickets.values())


def test_each_host_forwards_in_one_tree_and_to_its_own_servers_first() -> None:
    servers = [f"10.0.0.{host}:{port}" for host in range(1, 6) for port in (1, 2)]
    plan = relay_plan([servers], fanout=2)
    first, second = plan.trees_of(servers[0])
    # Tree 0: hosts 1, 3, 5 forward; tree 1: hosts 2, 4. A head's own server comes first.
    assert first.root == "10.0.0.1:1" and second.root == "10.0.0.2:1"
    assert first.children["10.0.0.1:1"] == ("10.0.0.1:2", "10.0.0.3:1", "10.0.0.5:1")
    assert first.children["10.0.0.3:1"] == ("10.0.0.3:2", "10.0.0.2:1", "10.0.0.4:1")
    assert first.children["10.0.0.2:1"] == ("10.0.0.2:2",)  # a leaf across hosts
    assert second.children["10.0.0.2:1"] == ("10.0.0.2:2", "10.0.0.4:1", "10.0.0.1:1")
    assert second.children["10.0.0.4:1"] == ("10.0.0.4:2", "10.0.0.3:1", "10.0.0.5:1")
    for tree in (first, second):
        assert sorted(tree.subtree(tree.root)) == sorted(servers)
    (chain,) = relay_plan([servers], fanout=1).trees_of(servers[0])
    assert chain.children["10.0.0.1:1"] == ("10.0.0.1:2", "10.0.0.2:1")
    assert chain.children["10.0.0.4:1"] == ("10.0.0.4:2", "10.0.0.5:1")
    with pytest.raises(ValueError, match="fan-out 0"):
        relay_plan([servers], fanout=0)


@pytest.mark.parametrize("fanout", [1, 2])
def test_every_hosts_link_carries_the_update_at_most_once_each_way(fanout: int) -> None:
    """Each tree carries 1/fanout of the update: a host receives every share once and sends
    what it forwards across hosts, at most one share to fanout children: the update once."""
    for hosts in range(1, 41):
        servers = [f"10.0.{h // 200}.{h % 200}:1" for h in range(hosts)]
        trees = relay_plan([servers], fanout).trees_of(servers[0])
        share = 1 / len(trees)
        for address in servers:
            sent = sum(len(tree.children.get(address, ())) * share for tree in trees)
            received = sum(share for tree in trees if tree.parents[address])
            assert sent <= 1 + 1e-9, (hosts, address, sent)
            assert received <= 1, (hosts, address)
        depth = max(len(_path(tree, a)) for tree in trees for a in servers)
        assert depth <= (hosts if fanout == 1 else 1 + math.ceil(math.log2(hosts + 1))), hosts


def test_auto_relays_whole_weights_down_one_chain_up_to_32_hosts_and_two_trees_else() -> None:
    """``auto`` (the default) by each group's hosts, not its servers: one stream per link
    while the chain's fill is small, the trees' log depth beyond, for patches (whose time is
    the hops' latency) and on links a core's stream cannot fill."""
    for hosts, trees_expected in [(2, 1), (32, 1), (33, 2), (200, 2)]:
        servers = [f"10.0.{h // 200}.{h % 200}:1" for h in range(hosts)]
        trees = relay_plan([servers], "auto").trees_of(servers[0])
        assert len(trees) == trees_expected, hosts
        if trees_expected == 1:
            assert max(len(_path(trees[0], a)) for a in servers) == hosts  # a chain
    # 40 servers on 20 hosts: a chain of the hosts, each host's second server below its first.
    paired = [f"10.0.1.{h}:{port}" for h in range(20) for port in (1, 2)]
    (chain,) = relay_plan([paired], "auto").trees_of(paired[0])
    assert chain.children["10.0.1.0:1"] == ("10.0.1.0:2", "10.0.1.1:1")
    assert fanout_for(paired, "auto") == 1 and fanout_for(paired, 3) == 3
    # Patches, and links found fast: two trees, whatever the hosts.
    plan = relay_plan([paired, paired[:4]], "auto", whole=[False, True])
    assert [len(trees) for trees in plan.groups] == [2, 1]
    assert [len(t) for t in relay_plan([paired], "auto", fast_links=True).groups] == [2]
    assert fanout_for(paired, 1, whole=False, fast_links=True) == 1  # asked for: kept
    for wrong in ("chain", -1, True):
        with pytest.raises(ValueError, match="give 'auto', 0"):
            fanout_for(paired, wrong)  # type: ignore[arg-type]


def test_the_pace_is_fast_once_a_long_stream_ran_faster_than_a_core_moves_one() -> None:
    pace = RelayPace()
    pace.observe(PACE_MIN_BYTES, PACE_MIN_BYTES / FAST_STREAM_BYTES_PER_SECOND * 2)
    pace.observe(PACE_MIN_BYTES - 1, 1e-6)  # short: says nothing
    pace.observe(PACE_MIN_BYTES, 0.0)
    assert not pace.fast
    pace.observe(PACE_MIN_BYTES, PACE_MIN_BYTES / FAST_STREAM_BYTES_PER_SECOND / 2)
    assert pace.fast
    pace.observe(PACE_MIN_BYTES, 100.0)  # once fast, kept: a slow stream is a busy moment
    assert pace.fast


def _path(tree: PlanTree, address: str) -> list[str]:
    path = [address]
    while tree.parents[path[-1]]:
        path.append(tree.parents[path[-1]])
    return path


def test_each_variant_of_an_update_gets_its_trees_and_old_servers_are_streamed_to_directly() -> (
    None
):
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
    # The patches' tree, the whole weights' tree.
    assert [trees[0].subtree(trees[0].root) for trees in relay.groups] == [
        ["h:1", "h:3"],
        ["h:2", "h:4"],
    ]
    assert not relay.relays("h:5") and relay.trees_of("h:5") == ()  # streamed to directly
    assert relay_for(plan, states, fanout=0) is None
    assert relay_for(plan, {"h:1": states["h:1"]}, fanout=1) is None


def test_shares_split_an_update_by_bytes_in_order() -> None:
    tensors = [(f"t{i}", torch.zeros(size)) for i, size in enumerate([10, 10, 30, 10, 40])]
    assert [[n for n, _ in s] for s in split_shares(tensors, 2)] == [
        ["t0", "t1", "t2"],
        ["t3", "t4"],
    ]
    assert [[n for n, _ in s] for s in split_shares(tensors, 1)] == [[n for n, _ in tensors]]
    assert split_shares(tensors[:1], 2) == [[], tensors[:1]]  # by its middle byte


def test_only_the_trainer_and_the_named_parent_stream_into_an_update() -> None:
    role = RelayRole.one_tree("b:1", "a:1", (RelayTarget("c:1", 0, b"t" * 16),))
    check_sender(role, "a:1")
    check_sender(role, "")  # the trainer, e.g. the whole weights after a refused patch
    check_sender(None, "")
    with pytest.raises(PermissionDenied, match="does not name"):
        check_sender(role, "x:9")
    with pytest.raises(PermissionDenied, match="no relay plan"):
        check_sender(None, "a:1")
    assert forwarded_tree(role, "a:1", None) == 0 and forwarded_tree(role, "", None) is None
    root = RelayRole.one_tree("a:1", "", (RelayTarget("b:1", 0, b"t" * 16),))
    assert forwarded_tree(root, "", None) == 0
    assert forwarded_tree(RelayRole.one_tree("c:1", "b:1"), "b:1", None) is None


def test_a_stream_of_a_plan_of_trees_names_its_tree() -> None:
    """In tree 0 b:1 forwards what a:1 sends it, in tree 1 it is a leaf below d:1: each
    parent only in its own tree, and a stream naming no tree is the trainer's, not relayed."""
    child = (RelayTarget("c:1", 0, b"t" * 16),)
    role = RelayRole("b:1", (RelayTree("a:1", child), RelayTree("d:1")), named=True)
    check_sender(role, "a:1", 0)
    check_sender(role, "d:1", 1)
    check_sender(role, "", None)
    for sender, tree in (("a:1", 1), ("d:1", 0), ("a:1", None), ("a:1", 2)):
        with pytest.raises(PermissionDenied):
            check_sender(role, sender, tree)
    assert forwarded_tree(role, "a:1", 0) == 0
    assert forwarded_tree(role, "d:1", 1) is None  # a leaf there
    assert forwarded_tree(role, "", None) is None  # the trainer's own stream: staged here only
    root = RelayRole("a:1", (RelayTree("", child), RelayTree("x:1")), named=True)
    assert forwarded_tree(root, "", 0) == 0 and forwarded_tree(root, "", None) is None


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
