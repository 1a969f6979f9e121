"""What happens when a placer moves a session away from a server: that server is told, so it
stops reporting the session (and every placer stops counting it there).

The router (for the sessions it places) and the trainer client (for the sessions it routes
directly) both call ``finish_moved_session``: one rule, one place.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc

log = logging.getLogger(__name__)


async def finish_moved_session(
    channel: grpc.aio.Channel,
    session_id: str,
    *,
    timeout: float,
    metadata: Sequence[tuple[str, str]] = (),
) -> None:
    """Ends ``session_id`` on the server behind ``channel``, which the session moved away from.
    Best effort: a server that is down ends the session by idleness, and its reports of the
    session are ignored until then, so a failure here is logged and dropped."""
    stub = data_plane_pb2_grpc.DataPlaneStub(channel)
    try:
        await stub.FinishSession(
            data_plane_pb2.FinishSessionRequest(session_id=session_id),
            timeout=timeout,
            metadata=tuple(metadata),
        )
    except grpc.aio.AioRpcError as error:
        log.debug("FinishSession of moved session %s: %s", session_id, error.code().name)
