"""Request metadata keys every side of the stack agrees on (gRPC metadata keys are lowercase)."""

from __future__ import annotations

from collections.abc import Iterable

#: Conversation id: the router sends every call carrying the same id to the same server.
SESSION_ID = "x-session-id"
#: `Bearer <token>` for servers and routers started with a token.
AUTHORIZATION = "authorization"
#: Set by the router on calls it forwards: the backend the call went to (for logs and tests).
ROUTED_TO = "x-skyrl-backend"


def session_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The ``x-session-id`` of a call's metadata, if it has one."""
    for key, value in metadata or ():
        if key == SESSION_ID:
            return value if isinstance(value, str) else value.decode()
    return None


def bearer(token: str) -> tuple[str, str]:
    """The metadata pair that authenticates a call with ``token``."""
    return (AUTHORIZATION, f"Bearer {token}")
