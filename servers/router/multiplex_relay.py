"""GenerateMultiplex through the router: a caller's requests on one call, each placed and relayed
as a GenerateStream call through the router would be, what advanced on all of them sent back as
one message.

A caller that keeps one GenerateMultiplex call (the trainer client's streams, another
``skyrl_grpc.multiplex`` user) would otherwise have the router relay that call whole to one
backend, its requests never placed by their sessions or load, never moved off a lost server.
Here each request added takes the proxy's path for a GenerateStream (``Proxy.generation``):
placed by its session (``GenerateBatchRequest.session_ids``) and the fleet's load, held while no
member serves, retried before its first chunk and migrated after, and on to its server over the
router's own multiplexed call there. Its chunks are numbered with the caller's index, and all
that advanced since the last message leaves as one (a slow caller's backlog merged per request,
as a server merges a slow reader's). A request's failure is its own ``BatchError``; the others
go on. A cancel ends the request on its server and sends nothing more of it. The call ends once
the caller has closed its side and every request has ended; a caller that goes away has every
request cancelled on its server. A malformed message, or an index still in use, ends the call
INVALID_ARGUMENT, as on a server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

from servers.common.grpc_types import Context
from servers.common.interceptors import abort_with_status
from servers.router.inner_call import CallFailed, InnerCall
from servers.router.proxy import Proxy, forwarded_metadata
from servers.router.upstreams import Metadata
from skyrl_grpc import tracing
from skyrl_grpc.batch_shape import batch_shape, check_unused
from skyrl_grpc.errors import InvalidArgument, SkyrlError
from skyrl_grpc.metadata import SESSION_ID
from skyrl_grpc.names import GENERATE_MULTIPLEX
from skyrl_grpc.stream_chunks import merge_backlog
from skyrl_grpc.v1 import data_plane_pb2

Chunk = data_plane_pb2.GenerateStreamResponse


class MultiplexRelay:
    """One GenerateMultiplex call through the router (see the module docstring)."""

    def __init__(self, proxy: Proxy, incoming: AsyncIterator[bytes], context: Context) -> None:
        self._proxy = proxy
        self._incoming = incoming
        self._context = context
        self._metadata = tuple((k, v) for k, v in forwarded_metadata(context) if k != SESSION_ID)
        self._running: dict[int, asyncio.Task[None]] = {}
        # Per request index: its chunks not sent yet, in order; and the errors not sent yet.
        self._waiting: dict[int, list[Chunk]] = {}
        self._errors: list[data_plane_pb2.BatchError] = []
        self._ready = asyncio.Event()
        self._caller_done = False  # the caller closed its side (or its stream failed)
        self._failure: SkyrlError | None = None  # ends the call

    # -- the caller's messages ----------------------------------------------------------------

    async def _read(self) -> None:
        try:
            async for raw in self._incoming:
                try:
                    message = data_plane_pb2.GenerateMultiplexRequest.FromString(raw)
                except Exception as error:
                    raise InvalidArgument(f"router: a message does not decode: {error}") from error
                if message.HasField("add"):
                    self._add(message.add, message.trace_context)
                for index in message.cancel:
                    self._cancel(index)
        except SkyrlError as error:
            self._failure = error
        except Exception:  # the caller's stream broke: its call is ending
            pass
        finally:
            self._caller_done = True
            self._ready.set()

    def _add(self, batch: data_plane_pb2.GenerateBatchRequest, trace: Any) -> None:
        indices, sessions = batch_shape(batch)
        # A request that ended but whose last chunks wait to be sent still holds its index.
        check_unused(indices, self._running.keys() | self._waiting.keys())
        # The request's own trace context, where its message carries one, in place of the call's.
        call = tracing.with_carried(self._metadata, trace) if trace else self._metadata
        for index, request, session in zip(indices, batch.requests, sessions, strict=True):
            metadata = (*call, (SESSION_ID, session)) if session else call
            self._running[index] = asyncio.ensure_future(self._run(index, request, metadata))

    def _cancel(self, index: int) -> None:
        task = self._running.pop(index, None)
        if task is not None:
            task.cancel()  # its path cancels the request upstream
            self._waiting.pop(index, None)

    # -- each request -------------------------------------------------------------------------

    async def _run(
        self, index: int, request: data_plane_pb2.GenerateStreamRequest, metadata: Metadata
    ) -> None:
        context = InnerCall(metadata, self._context.time_remaining).context()
        first = True
        try:
            relayed = self._proxy.generation(request, context)
            async with contextlib.aclosing(relayed):  # type: ignore[type-var]
                async for chunk in relayed:
                    chunk.batch_index = index
                    if not first:
                        chunk.ClearField("request_id")  # a request's first chunk names it
                    first = False
                    self._waiting.setdefault(index, []).append(chunk)
                    self._ready.set()
        except CallFailed as failed:
            error = data_plane_pb2.BatchError(
                index=index, code=failed.code.value[0], message=failed.details
            )
            self._errors.append(error)
        finally:
            if self._running.get(index) is asyncio.current_task():
                del self._running[index]
            self._ready.set()

    # -- the caller's stream ------------------------------------------------------------------

    def _take(self) -> bytes:
        """All that advanced since the last message, as one (empty: nothing did)."""
        if not self._waiting and not self._errors:
            return b""
        response = data_plane_pb2.GenerateMultiplexResponse(errors=self._errors)
        for chunks in self._waiting.values():
            response.chunks.extend(chunks if len(chunks) == 1 else merge_backlog(chunks))
        self._waiting.clear()
        self._errors = []
        return response.SerializeToString()

    async def relay(self) -> AsyncGenerator[bytes, None]:
        reading = asyncio.ensure_future(self._read())
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                if self._failure is not None:  # the reader has stopped: the call ends now
                    await abort_with_status(self._failure, self._context, GENERATE_MULTIPLEX)
                if message := self._take():
                    yield message
                if self._caller_done and not self._running and not self._waiting:
                    return
        finally:
            reading.cancel()
            await _cancelled(self._running.values())


async def _cancelled(tasks: Iterable[asyncio.Task[None]]) -> None:
    """``tasks`` cancelled and ended (their requests cancelled upstream)."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    if pending:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pending, return_exceptions=True)


async def relay_multiplex(
    proxy: Proxy, incoming: AsyncIterator[bytes], context: Context
) -> AsyncIterator[bytes]:
    """The handler of GenerateMultiplex on the router."""
    relayed = MultiplexRelay(proxy, incoming, context).relay()
    async with contextlib.aclosing(relayed):
        async for message in relayed:
            yield message
