"""A server's place in a weight update's relay plan (``StartWeightUpdateRequest.relay``), as
plain values: how the plan names it, where its streams come from, which servers it forwards
every frame to. The open update keeps it; streams are checked against it before anything is
staged."""

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
class RelayRole:
    """``address``: how the plan names this server; ``parent``: where its streams come from
    ("": the trainer); ``children``: the servers it forwards to."""

    address: str
    parent: str
    children: tuple[RelayTarget, ...] = ()


def check_sender(role: RelayRole | None, relayed_from: str) -> None:
    """Refuses (PERMISSION_DENIED) a stream relayed by a peer (``relayed_from``) that is not
    this server's relay parent: into an update with no relay plan, or from a peer the plan
    does not name as the parent. The trainer ("") may always stream directly (it holds the
    ticket, or the control token): a server that refused a patch gets the whole weights so."""
    if not relayed_from:
        return
    if role is None:
        raise PermissionDenied(
            f"a stream relayed from {relayed_from} into an update with no relay plan: only the "
            "trainer that opened it streams into it; refused, nothing staged"
        )
    if relayed_from != role.parent:
        raise PermissionDenied(
            f"a stream relayed from {relayed_from}, which the update's relay plan does not name "
            f"as {role.address}'s parent ({role.parent or 'the trainer'}): refused, nothing "
            "staged"
        )


def forwards(role: RelayRole | None, relayed_from: str) -> bool:
    """Whether a stream from ``relayed_from`` goes on down the relay plan: it comes from this
    server's relay parent (the trainer, for a root) and the plan names servers below."""
    return role is not None and bool(role.children) and relayed_from == role.parent
