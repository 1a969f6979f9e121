"""Who relays an in-band update to whom: the trainer sends each byte of an update once, and the
servers forward what they receive to each other as it arrives
(``servers.engine.peers.relay``), so what the trainer sends does not grow with the fleet; and
every host's link carries each byte at most once each way, so neither does the time: a full
update takes about the model's bytes over the slowest link it must cross (the floor), at
any fleet size.

The servers that get the same bytes (patches against the update's base, the same patches
compressed, or the whole weights: ``UpdatePlan``) form one group. A group's update is split
into ``fanout`` shares (``ClientConfig.weight_relay_fanout``; ``auto`` below), each sent down a
relay tree of its own in which every forwarding server has ``fanout`` children; the servers
that forward in tree ``i`` are the hosts ``i``, ``i + fanout``, ... and every other host is a
leaf of it, so a host forwards in one tree only and its uplink carries one share ``fanout``
times: the update once (the trees NCCL's double binary tree broadcast uses, generalised). A
tree's depth is ``log_fanout`` of the hosts, so the time the pipeline takes to fill is a few
frames at 1000 hosts. ``fanout`` 1 is a chain: one share, every host forwarding it once.

``auto`` (the default) picks per group: a chain for the whole weights up to
``CHAIN_MAX_HOSTS`` hosts, two trees otherwise. Measured on the testbed (docs/weights.md): a
chain gives every downlink and uplink one stream, where two trees give each downlink two, which
TCP does not share evenly (full updates at 4 hosts: 1.10x the link's floor against the trees'
1.15x, and 1.13x against 1.31x with a trainer's link 4x a server's); but a chain's every hop
adds its latency in turn, which a patch (an RL step's delta, a few MB, all latency) feels at a
fleet's size and the trees' log depth does not (on the testbed's 4 and 8 hosts the two were
even), and its fill, a chunk's time per hop (1/512 of the update), reaches 6% of the floor at
``CHAIN_MAX_HOSTS``. Where
one stream is held by a core rather than by the link (``RelayPace``: the trainer's stream into
a chain ran faster than ``FAST_STREAM_BYTES_PER_SECOND``; ``scripts/simulate_relay.py``: two
trees are 1.5x faster than a chain at 100 Gbit/s), the trees' streams side by side win: after
such an update, ``auto`` relays down two trees.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from skyrl_grpc.push_socket_client import host_of
from trainer_client.config import RelayFanout
from trainer_client.weights.update_plan import WHOLE, ServerState, UpdatePlan, Variant

# Bytes of randomness in a ticket (the servers take 16 or more).
TICKET_BYTES = 16
# ``auto``: a group of up to this many hosts relays the whole weights down one chain.
CHAIN_MAX_HOSTS = 32
AUTO_TREES = 2
# A relayed stream faster than this (25 Gbit/s; one relay stream moves 5-6 GB/s of a core):
# the link is not what holds a chain, a core is.
FAST_STREAM_BYTES_PER_SECOND = 3.1e9
# Streams shorter than this say little about the link's pace (a delta's, a handshake's).
PACE_MIN_BYTES = 64 << 20


class RelayPace:
    """What the trainer's relayed streams of whole weights showed of the links: ``fast``
    once one ran faster than ``FAST_STREAM_BYTES_PER_SECOND``."""

    def __init__(self) -> None:
        self.fast = False

    def observe(self, sent_bytes: int, seconds: float) -> None:
        if sent_bytes >= PACE_MIN_BYTES and seconds > 0:
            self.fast = self.fast or sent_bytes / seconds > FAST_STREAM_BYTES_PER_SECOND


def hosts_of(servers: Sequence[str]) -> dict[str, list[str]]:
    """``servers`` by host, in order (an address with no host part is a host of its own)."""
    by_host: dict[str, list[str]] = {}
    for address in servers:
        by_host.setdefault(host_of(address) or address, []).append(address)
    return by_host


def fanout_for(
    servers: Sequence[str], fanout: RelayFanout, whole: bool = True, fast_links: bool = False
) -> int:
    """The fan-out a group of ``servers`` relays with: ``fanout`` itself, or ``auto``'s choice
    (a chain for the ``whole`` weights up to ``CHAIN_MAX_HOSTS`` hosts on links slower than a
    core's stream, else ``AUTO_TREES`` trees)."""
    if fanout == "auto":
        chain = whole and not fast_links and len(hosts_of(servers)) <= CHAIN_MAX_HOSTS
        return 1 if chain else AUTO_TREES
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 0:
        raise ValueError(
            f"weight_relay_fanout {fanout!r}: give 'auto', 0 (no relay), 1 (a chain) or the "
            "trees' fan-out"
        )
    return fanout


@dataclass(frozen=True)
class RelayTree:
    """One relay tree: each member's parent ("": the root, which the trainer streams to) and
    its children, in the order it forwards to them."""

    parents: Mapping[str, str]
    children: Mapping[str, tuple[str, ...]]

    @property
    def root(self) -> str:
        return next(address for address, parent in self.parents.items() if not parent)

    def subtree(self, address: str) -> list[str]:
        """``address`` and every server below it, in the order the relay reaches them."""
        found, pending = [], [address]
        while pending:
            member = pending.pop(0)
            found.append(member)
            pending.extend(self.children.get(member, ()))
        return found


@dataclass(frozen=True)
class RelayPlan:
    """Each group's relay trees (one per share of the update: a group's ``i``-th tree carries
    its ``i``-th share) and every relayed server's ticket."""

    groups: tuple[tuple[RelayTree, ...], ...]
    tickets: Mapping[str, bytes] = field(default_factory=dict)

    def relays(self, address: str) -> bool:
        return address in self.tickets

    def trees_of(self, address: str) -> tuple[RelayTree, ...]:
        """The trees of ``address``'s group (none: it is not relayed)."""
        for trees in self.groups:
            if address in trees[0].parents:
                return trees
        return ()


def relay_plan(
    groups: Iterable[Sequence[str]],
    fanout: RelayFanout,
    whole: Sequence[bool] | None = None,
    fast_links: bool = False,
) -> RelayPlan:
    """``fanout`` relay trees over each group of servers in ``groups`` (each group gets the same
    bytes: the ``whole`` weights or not, default all; ``auto``: ``fanout_for`` each), or as
    many as the group has hosts; a group of one server is one tree of one."""
    if fanout != "auto" and fanout_for((), fanout) < 1:
        raise ValueError(f"relay fan-out {fanout}: give 1 or more (0 turns relaying off)")
    listed = list(groups)
    kinds = [True] * len(listed) if whole is None else list(whole)
    planned = tuple(
        _trees(servers, fanout_for(servers, fanout, kind, fast_links))
        for servers, kind in zip(listed, kinds, strict=True)
    )
    tickets = {
        address: secrets.token_bytes(TICKET_BYTES)
        for trees in planned
        for address in trees[0].parents
    }
    return RelayPlan(planned, tickets)


def _trees(servers: Sequence[str], fanout: int) -> tuple[RelayTree, ...]:
    """The trees of one group: per tree, the hosts' first servers (heads) in a ``fanout``-ary
    tree whose forwarding heads are those of that tree's hosts (``i``, ``i + fanout``, ...)
    first, the other heads leaves; each head's own servers in a chain below it, first among
    its children."""
    by_host = hosts_of(servers)
    heads = [members[0] for members in by_host.values()]
    local: dict[str, str] = {}
    for members in by_host.values():
        for previous, member in itertools.pairwise(members):
            local[member] = previous
    trees = []
    for tree in range(min(fanout, len(heads))):
        forwarding = heads[tree::fanout]
        order = forwarding + [head for head in heads if head not in forwarding]
        across = {head: order[(i - 1) // fanout] if i else "" for i, head in enumerate(order)}
        parents = {**across, **local}
        children: dict[str, list[str]] = {}
        # A head's local server first: loopback, which the next host's stream does not share.
        for address, parent in sorted(parents.items(), key=lambda item: item[0] in across):
            if parent:
                children.setdefault(parent, []).append(address)
        trees.append(RelayTree(parents, {p: tuple(c) for p, c in children.items()}))
    return tuple(trees)


def relay_for(
    plan: UpdatePlan,
    states: Mapping[str, ServerState],
    fanout: RelayFanout,
    fast_links: bool = False,
) -> RelayPlan | None:
    """The relay plan of ``plan``'s servers that relay down trees (``states``: what each said
    before the update; one that did not answer, or an older server, is streamed to
    directly), one group per variant of the update (``fast_links``: ``RelayPace.fast``);
    None when fewer than two relay or ``fanout`` is 0."""
    relaying = [a for a in plan.servers if (s := states.get(a)) is not None and s.relays]
    if fanout_for(relaying, fanout) == 0 or len(relaying) < 2:
        return None
    groups: dict[Variant, list[str]] = {}
    for address in relaying:
        groups.setdefault(plan.variant(address), []).append(address)
    whole = [variant == WHOLE for variant in groups]
    return relay_plan(groups.values(), fanout, whole, fast_links)
