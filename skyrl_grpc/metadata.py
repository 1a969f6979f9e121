"""Request metadata keys every side of the stack agrees on (gRPC metadata keys are lowercase)."""

from __future__ import annotations

from collections.abc import Iterable

#: Conversation id: the router sends every call carrying the same id to the same server.
SESSION_ID = "x-session-id"
#: `Bearer <token>` for servers and routers started with a token.
AUTHORIZATION = "authorization"
#: Set by the router on calls it forwards: the backend the call went to (for logs and tests).
ROUTED_TO = "x-skyrl-backend"
#: On a PushWeights call a server relays to the next: the update's ticket at the receiver
#: (StartWeightUpdateRequest.push_ticket), and who forwards (its name in the relay plan).
PUSH_TICKET = "x-skyrl-push-ticket-bin"
RELAYED_FROM = "x-skyrl-relayed-from"
#: ... and the relay tree the stream travels down (``WeightRelayRole.trees``' index, decimal).
RELAY_TREE = "x-skyrl-relay-tree"
#: Trailing metadata of a relayed PushWeights call that failed somewhere below: a serialized
#: ``RelayFailures`` naming every server of the subtree that did not stage the stream.
RELAY_FAILURES = "x-skyrl-relay-failures-bin"


def session_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The ``x-session-id`` of a call's metadata, if it has one."""
    for key, value in metadata or ():
        if key == SESSION_ID:
            return value if isinstance(value, str) else value.decode()
    return None


def bearer(token: str) -> tuple[str, str]:
    """The metadata pair that authenticates a call with ``token``."""
    return (AUTHORIZATION, f"Bearer {token}")
