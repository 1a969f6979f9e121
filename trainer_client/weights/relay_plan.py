"""Who relays an in-band update to whom: the trainer sends each of the update's streams once,
to the root of a relay tree, and every server forwards each frame to its children as it
arrives (``servers.engine.peers.relay``), so what the trainer sends does not grow with the
fleet.

The servers that get the same bytes (patches against the update's base, the same patches
compressed, or the whole weights: ``UpdatePlan``) form one tree each. In a tree, the servers
on one host (one Ray node) relay to each other in a chain before anything crosses hosts; the
hosts form a tree of ``fanout`` children per host (``ClientConfig.weight_relay_fanout``: 2 by
default, what ``scripts/simulate_relay.py`` finds fastest for deltas; 1, a chain of hosts,
for full updates on slow links: docs/weights.md). Each relayed server gets a ticket the
trainer chooses, so one round of StartWeightUpdate hands every server its place and its
children's tickets.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from skyrl_grpc.push_socket_client import host_of
from trainer_client.weights.update_plan import ServerState, UpdatePlan, Variant

# Bytes of randomness in a ticket (the servers take 16 or more).
TICKET_BYTES = 16


@dataclass(frozen=True)
class RelayPlan:
    """Each relayed server's parent ("": the trainer streams to it) and children, and its
    ticket for the update."""

    parents: Mapping[str, str]
    children: Mapping[str, tuple[str, ...]]
    tickets: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def roots(self) -> list[str]:
        return [address for address, parent in self.parents.items() if not parent]

    def subtree(self, root: str) -> list[str]:
        """``root`` and every server below it, in the order the relay reaches them."""
        found, pending = [], [root]
        while pending:
            address = pending.pop(0)
            found.append(address)
            pending.extend(self.children.get(address, ()))
        return found

    def relays(self, address: str) -> bool:
        return address in self.parents


def relay_plan(trees: Iterable[Sequence[str]], fanout: int) -> RelayPlan:
    """One relay tree over each group of servers in ``trees`` (each group gets the same
    bytes); a group of one server is a tree too (its root streams alone)."""
    if fanout < 1:
        raise ValueError(f"relay fan-out {fanout}: give 1 or more (0 turns relaying off)")
    parents: dict[str, str] = {}
    for servers in trees:
        parents.update(_tree(servers, fanout))
    children: dict[str, list[str]] = {}
    for address, parent in parents.items():
        if parent:
            children.setdefault(parent, []).append(address)
    return RelayPlan(
        parents=parents,
        children={parent: tuple(below) for parent, below in children.items()},
        tickets={address: secrets.token_bytes(TICKET_BYTES) for address in parents},
    )


def _tree(servers: Sequence[str], fanout: int) -> dict[str, str]:
    """Each server's parent: a chain on each host, its first server the host's head; the heads
    in a tree of ``fanout`` children each, in the order the hosts first appear. Each head's
    local child comes first among its children (the parent map keeps insertion order)."""
    by_host: dict[str, list[str]] = {}
    for address in servers:
        by_host.setdefault(host_of(address) or address, []).append(address)
    parents: dict[str, str] = {}
    heads = [members[0] for members in by_host.values()]
    for members in by_host.values():
        parents[members[0]] = ""  # placed below
        for previous, member in itertools.pairwise(members):
            parents[member] = previous
    for index, head in enumerate(heads):
        parents[head] = heads[(index - 1) // fanout] if index else ""
    # Children in the order a parent forwards: its local one before the other hosts'.
    ordered = {a: p for a, p in parents.items() if p and host_of(a) == host_of(p)}
    ordered.update({a: p for a, p in parents.items() if a not in ordered})
    return ordered


def relay_for(plan: UpdatePlan, states: Mapping[str, ServerState], fanout: int) -> RelayPlan | None:
    """The relay plan of ``plan``'s servers that relay (``states``: what each said before the
    update; one that did not answer, or an older server, is streamed to directly), one tree
    per variant of the update; None when fewer than two relay or ``fanout`` is 0."""
    relaying = [a for a in plan.servers if (s := states.get(a)) is not None and s.relays]
    if fanout <= 0 or len(relaying) < 2:
        return None
    trees: dict[Variant, list[str]] = {}
    for address in relaying:
        trees.setdefault(plan.variant(address), []).append(address)
    return relay_plan(trees.values(), fanout)
