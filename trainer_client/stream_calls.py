"""A generation's stream from a server or the router: over the one GenerateMultiplex call the
client keeps to each (``ClientConfig.multiplex``; through the router, each request of the call is
placed by its session: ``servers.router.multiplex_relay``), or a GenerateStream call of its own
(``multiplex=False``, or to one without GenerateMultiplex).

On a GenerateStream call per generation, 64 concurrent streams cost 64 gRPC messages an engine
step at the server and in the client, each worth a token; grpc's asyncio client spends tens of
microseconds on each, on the trainer's cores. Multiplexed, the server sends one message a step
for all of them and the client hands each stream its chunk (``skyrl_grpc.multiplex``, the
router's own way to its servers). Either way a stream reads the same chunks and fails the same
way: a server lost fails it UNAVAILABLE, its deadline DEADLINE_EXCEEDED (on a multiplexed call
the client keeps the deadline and cancels the request, which aborts it on the server), and
closing it cancels the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from skyrl_grpc.multiplex import WithFallback, rpc_error
from skyrl_grpc.v1 import data_plane_pb2
from trainer_client.client_core import ClientCore

Chunk = data_plane_pb2.GenerateStreamResponse
Metadata = tuple[tuple[str, str], ...]


class StreamCall:
    """One generation's chunks (``chunks``), and ``cancel``."""

    def __init__(self, call: Any, deadline: float | None, multiplexed: bool) -> None:
        self._call = call
        self._multiplexed = multiplexed
        self._deadline_at = (
            None if deadline is None else asyncio.get_running_loop().time() + deadline
        )

    async def chunks(self) -> AsyncGenerator[Chunk, None]:
        if not self._multiplexed:  # grpc keeps the call's deadline
            async for chunk in self._call:
                yield chunk
            return
        while True:
            if self._deadline_at is None:
                chunk = await self._call.read()
            else:
                try:
                    async with asyncio.timeout_at(self._deadline_at):
                        chunk = await self._call.read()
                except TimeoutError:
                    deadline = grpc.StatusCode.DEADLINE_EXCEEDED
                    raise rpc_error(deadline, "Deadline Exceeded") from None
            if chunk is grpc.aio.EOF:
                return
            yield chunk

    def cancel(self) -> None:
        self._call.cancel()


def open_stream(
    core: ClientCore,
    target: str | None,
    request: data_plane_pb2.GenerateStreamRequest,
    deadline: float | None,
    metadata: Metadata,
) -> StreamCall:
    """``request``'s stream from the server ``target`` (None: through the router), with
    ``deadline`` seconds (None: none) and the call ``metadata`` (its session's header)."""
    stub = core.data(target)

    def plain() -> Any:
        return stub.GenerateStream(request, timeout=deadline, metadata=metadata)

    if not core.config.multiplex:
        return StreamCall(plain(), deadline, multiplexed=False)
    if target is None:  # the router places each request of the call by its session
        address, channel = core.config.router, core.channel(core.config.router)
    else:
        address, channel = target, core.connections.data_channel(target)
    multiplexers = core.connections.multiplexers()
    if not multiplexers.supported(address):
        return StreamCall(plain(), deadline, multiplexed=False)
    stream = multiplexers.open(
        address,
        channel,
        request,
        metadata,
        parsed=True,
        call_metadata=core.config.call_metadata("data"),
    )
    fallback = WithFallback(stream, plain, lambda: multiplexers.unsupported(address))
    return StreamCall(fallback, deadline, multiplexed=True)
