"""A server's place in a weight update's relay plan (``StartWeightUpdateRequest.relay``), as
plain values: how the plan names it and, in each relay tree of the update, where that tree's
streams come from and which servers it forwards them to. The open update keeps it; streams are
checked against it before anything is staged.

A plan of several trees splits the update into one share per tree, and a server forwards in at
most one of them, so each server's link carries each byte once each way (the trainer's plan,
``trainer_client.weights.relay_plan``); each stream names its tree. A plan of one tree (what
servers relayed before trees) names none: its streams are the tree's."""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_grpc.errors import PermissionDenied

# A trainer-chosen ticket shorter than this is not one (the server's own are 16 bytes).
MIN_TICKET_BYTES = 16


@dataclass(frozen=True)
class RelayTarget:
    """A server this one forwards to: its address, push socket port (0: over gRPC) and its
    ticket for the update."""

    address: str
    push_socket_port: int
    ticket: bytes


@dataclass(frozen=True)
class RelayTree:
    """This server's place in one relay tree: ``parent``, where the tree's streams come from
    ("": the trainer); ``children``, the servers it forwards them to."""

    parent: str
    children: tuple[RelayTarget, ...] = ()


@dataclass(frozen=True)
class RelayRole:
    """``address``: how the plan names this server; ``trees``: its place in each tree;
    ``named``: whether streams name their tree (a plan of trees) or are all of the one
    tree."""

    address: str
    trees: tuple[RelayTree, ...]
    named: bool = False

    @classmethod
    def one_tree(
        cls, address: str, parent: str, children: tuple[RelayTarget, ...] = ()
    ) -> RelayRole:
        return cls(address, (RelayTree(parent, children),))

    def tree_of(self, tree: int | None) -> RelayTree | None:
        """The tree a stream naming ``tree`` (None: none) travels down, if any."""
        if not self.named:
            return self.trees[0]
        if tree is None or not 0 <= tree < len(self.trees):
            return None
        return self.trees[tree]


def check_sender(role: RelayRole | None, relayed_from: str, tree: int | None = None) -> None:
    """Refuses (PERMISSION_DENIED) a stream relayed by a peer (``relayed_from``) that is not
    this server's relay parent in the tree the stream names: into an update with no relay plan,
    naming no tree of the plan, or from a peer the plan does not name as that tree's parent.
    The trainer ("") may always stream directly (it holds the ticket, or the control token): a
    server that refused a patch gets the whole weights so."""
    if not relayed_from:
        return
    if role is None:
        raise PermissionDenied(
            f"a stream relayed from {relayed_from} into an update with no relay plan: only the "
            "trainer that opened it streams into it; refused, nothing staged"
        )
    place = role.tree_of(tree)
    if place is None:
        raise PermissionDenied(
            f"a stream relayed from {relayed_from} names relay tree {tree}, which is not one "
            f"of the {len(role.trees)} of {role.address}'s plan: refused, nothing staged"
        )
    if relayed_from != place.parent:
        raise PermissionDenied(
            f"a stream relayed from {relayed_from}, which the update's relay plan does not name "
            f"as {role.address}'s parent ({place.parent or 'the trainer'}): refused, nothing "
            "staged"
        )


def forwarded_tree(role: RelayRole | None, relayed_from: str, tree: int | None) -> int | None:
    """The tree a stream from ``relayed_from`` naming ``tree`` goes on down (its index), or
    None: it comes from this server's parent in that tree and the tree names servers below."""
    if role is None:
        return None
    place = role.tree_of(tree)
    if place is None or not place.children or relayed_from != place.parent:
        return None
    return tree if role.named else 0
