"""Sessions in tests: where a router places one (``routed_to``), and ending what earlier tests
left on the shared engine servers (``end_every_session``: their sessions live on for
``SESSION_IDLE_SECONDS`` and then end by idleness in the middle of whatever test runs then; a
test that counts sessions starts from none instead)."""

from __future__ import annotations

from typing import Any

import grpc

from skyrl_grpc.metadata import ROUTED_TO, SESSION_ID
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc


async def routed_to(channel: grpc.aio.Channel, session: str) -> str:
    """The server the router behind ``channel`` sends ``session`` to (a Tokenize call names it
    in its answer's metadata)."""
    call = data_plane_pb2_grpc.DataPlaneStub(channel).Tokenize(
        data_plane_pb2.TokenizeRequest(text="x"), metadata=((SESSION_ID, session),)
    )
    await call
    return str(dict(await call.initial_metadata())[ROUTED_TO])


async def end_every_session(servers: list[Any]) -> None:
    """Finishes every live session on each in-process engine server, through its DataPlane."""
    for server in servers:
        live = server.state.started.sessions.snapshot()
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = data_plane_pb2_grpc.DataPlaneStub(channel)
            for session in live:
                await stub.FinishSession(data_plane_pb2.FinishSessionRequest(session_id=session))
