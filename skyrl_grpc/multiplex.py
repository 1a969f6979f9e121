"""A caller's streams to a server over one GenerateMultiplex call: the router's forwarded
GenerateStream calls, and the trainer client's generations sent straight to a server.

Every GenerateStream as its own call costs a gRPC message per request per engine step at the
server and again at the reading end: with 64 streams, 64 messages a step, each worth one
token. A caller instead keeps one long-lived GenerateMultiplex call per server (and per
caller credential: a server's data token is checked on the call, so callers with different
tokens never share one), adds each request to it, and the server sends one message per engine
step for all of them (TGI's router does the same with its shards). ``Multiplexer.open`` returns
a ``MuxStream``: the request's own chunks, read like a call's answers (``read``, ``cancel``,
``done``), so retries and migration work unchanged. Chunks that wait while the reader is slow
are merged (``skyrl_grpc.stream_chunks``): a slow reader costs fewer messages, not more latency.

A request's error (``BatchError``) fails its stream with that status; the call failing (the
server lost) fails every stream on it, each then retried or migrated by its caller (the
router's proxy, the client's failover) as if its own call had failed; the next request opens a
new call. A server without GenerateMultiplex (an older one) answers UNIMPLEMENTED once and gets
plain calls from then on.

That answer can reach the caller disguised: a server without the method answers at once,
without reading, and when its status beats the caller's write of the first request, grpc's
client reports the call as INTERNAL "Internal error from Core" (1 new call in 300 to 1000 here,
more on a busy machine) -- what a broken connection also looks like. A call that fails so
before the server sent anything is settled by a plain call to the same server
(``WithFallback``): a server without the method answers it, a lost one fails it UNAVAILABLE
and the caller moves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from skyrl_grpc import tracing
from skyrl_grpc.errors import TRANSPORT_BROKE, status_of
from skyrl_grpc.metadata import AUTHORIZATION, session_of
from skyrl_grpc.names import GENERATE_MULTIPLEX
from skyrl_grpc.stream_chunks import merge_backlog
from skyrl_grpc.v1 import data_plane_pb2

log = logging.getLogger(__name__)
Metadata = tuple[tuple[str, str | bytes], ...]


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A call's failure made here, read by callers as grpc's own (no metadata)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class MuxStream:
    """One request's chunks on a multiplexed call (``upstreams.Upstream``)."""

    def __init__(self, mux: Multiplexer, index: int, samples: int, parsed: bool = False) -> None:
        self._mux = mux
        self.index = index
        # ``read`` returns the chunk itself (for a caller in this process: the HTTP edge),
        # else its bytes (for a gRPC caller).
        self._parsed = parsed
        self._open_samples = samples
        self._chunks: deque[data_plane_pb2.GenerateStreamResponse] = deque()
        self._error: grpc.aio.AioRpcError | None = None
        self._ready = asyncio.Event()
        self._done = False
        self.request_id = ""
        self.tokens_read = 0  # the tokens of the message ``read`` returned last (metrics)

    @property
    def call_answered(self) -> bool:
        """Whether the server has sent anything on the multiplexed call this stream is on."""
        return self._mux.answered

    @property
    def finished(self) -> bool:
        """Every sample has ended, or the stream failed or was cancelled."""
        return self._done

    def deliver(self, chunk: data_plane_pb2.GenerateStreamResponse) -> None:
        if chunk.request_id:
            self.request_id = chunk.request_id
        else:
            chunk.request_id = self.request_id
        chunk.batch_index = 0
        self._chunks.append(chunk)
        if chunk.finish_reason:
            self._open_samples -= 1
            if self._open_samples <= 0:
                self._done = True
        self._ready.set()

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if not self._done:
            self._error = error
            self._done = True
            self._ready.set()

    async def read(self) -> Any:
        """The next message to relay (chunks that waited merged; parsed or as bytes, as the
        stream was opened), or ``grpc.aio.EOF``."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return grpc.aio.EOF
            self._ready.clear()
            await self._ready.wait()
        if len(self._chunks) > 1:  # a slow reader: what waited leaves as one message per sample
            waiting = list(self._chunks)
            self._chunks.clear()
            merged = merge_backlog(waiting)
            self._chunks.extend(merged[1:])
            chunk = merged[0]
        else:
            chunk = self._chunks.popleft()
        self.tokens_read = len(chunk.token_ids)
        return chunk if self._parsed else chunk.SerializeToString()

    def cancel(self) -> bool:
        if self._done:
            return False
        self._done = True
        self._mux.cancel(self.index)
        return True

    def done(self) -> bool:
        return self._done and not self._chunks


# The most requests one merged message adds (a server refuses a message of more than its
# capacity whole where it predates taking them one by one: 5120 by default).
MERGED_REQUESTS = 64


class Outbox:
    """A multiplexed call's messages to send, those that waited while a write was under way
    merged into one: a burst of opened streams (a batch, or 64 edge requests that began
    together) costs one gRPC write instead of one each, and a write costs the caller ~60 us of
    CPU whatever its size. Adds are merged in order, so the server admits them in the order
    they were opened; a message carrying its own trace context is sent alone (the context is
    its requests')."""

    def __init__(self) -> None:
        self._waiting: deque[data_plane_pb2.GenerateMultiplexRequest] = deque()
        self._ready = asyncio.Event()
        self._closed = False

    def put(self, message: data_plane_pb2.GenerateMultiplexRequest) -> None:
        """``message`` to send: its adds name one session and one index per request."""
        self._waiting.append(message)
        self._ready.set()

    def close(self) -> None:
        """Nothing more: ``take`` returns None once what waits has been taken."""
        self._closed = True
        self._ready.set()

    async def take(self) -> data_plane_pb2.GenerateMultiplexRequest | None:
        """The next message to write (what waited merged into it), or None once closed."""
        while not self._waiting:
            if self._closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        message = self._waiting.popleft()
        while self._waiting and _mergeable(message, self._waiting[0]):
            following = self._waiting.popleft()
            message.add.requests.extend(following.add.requests)
            message.add.session_ids.extend(following.add.session_ids)
            message.add.indices.extend(following.add.indices)
            message.cancel.extend(following.cancel)
        return message


def _mergeable(
    message: data_plane_pb2.GenerateMultiplexRequest,
    following: data_plane_pb2.GenerateMultiplexRequest,
) -> bool:
    return (
        not message.trace_context
        and not following.trace_context
        and len(message.add.requests) + len(following.add.requests) <= MERGED_REQUESTS
    )


class Multiplexer:
    """One GenerateMultiplex call to a server, shared by its caller's streams."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Metadata) -> None:
        self._outbox = Outbox()
        self._streams: dict[int, MuxStream] = {}
        self._next_index = 0
        self.failed: grpc.aio.AioRpcError | None = None
        # The server has sent a message on the call (so it takes GenerateMultiplex).
        self.answered = False
        method: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(
            GENERATE_MULTIPLEX
        )
        self._call = method(self._requests(), metadata=metadata)
        self._reader = asyncio.ensure_future(self._read())

    @property
    def alive(self) -> bool:
        return self.failed is None

    async def _requests(self) -> AsyncIterator[bytes]:
        while (message := await self._outbox.take()) is not None:
            yield message.SerializeToString()

    def open(
        self, request: data_plane_pb2.GenerateStreamRequest, session: str, parsed: bool = False
    ) -> MuxStream:
        """Adds ``request`` (with its session) to the call; returns its stream (``parsed``:
        read as chunks, not bytes)."""
        if self.failed is not None:
            raise self.failed
        index = self._next_index
        self._next_index += 1
        stream = MuxStream(self, index, max(request.n, 1), parsed)
        self._streams[index] = stream
        add = data_plane_pb2.GenerateBatchRequest(
            requests=[request], session_ids=[session], indices=[index]
        )
        message = data_plane_pb2.GenerateMultiplexRequest(add=add)
        if tracing.enabled():  # the caller's span of the request (current here)
            message.trace_context.update(tracing.headers())
        self._outbox.put(message)
        return stream

    def cancel(self, index: int) -> None:
        if self._streams.pop(index, None) is not None and self.failed is None:
            self._outbox.put(data_plane_pb2.GenerateMultiplexRequest(cancel=[index]))

    async def _read(self) -> None:
        try:
            async for raw in self._call:
                self.answered = True
                message = data_plane_pb2.GenerateMultiplexResponse.FromString(raw)
                for chunk in message.chunks:
                    stream = self._streams.get(chunk.batch_index)
                    if stream is not None:
                        stream.deliver(chunk)  # renumbers the chunk for its caller
                        if stream.finished:
                            self._streams.pop(stream.index, None)
                for error in message.errors:
                    stream = self._streams.pop(error.index, None)
                    if stream is not None:
                        stream.fail(rpc_error(status_of(error.code), error.message))
            failure = rpc_error(grpc.StatusCode.UNAVAILABLE, "the multiplexed call ended")
        except grpc.aio.AioRpcError as error:
            failure = error
        except asyncio.CancelledError:
            failure = rpc_error(grpc.StatusCode.UNAVAILABLE, "the caller closed the call")
        self.failed = failure
        for stream in list(self._streams.values()):
            stream.fail(failure)
        self._streams.clear()

    def retire(self) -> None:
        """No new requests: the caller's side of the call is closed, and the server ends it
        once the requests running on it have ended (a draining server finishes them)."""
        self._outbox.close()

    def on_end(self, callback: Callable[[Multiplexer], None]) -> None:
        """Calls ``callback(self)`` once the call has ended."""
        self._reader.add_done_callback(lambda _: callback(self))

    async def close(self) -> None:
        """Ends the call now: those running are cut (their streams fail UNAVAILABLE, to be
        retried or migrated elsewhere)."""
        self._outbox.close()
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class Multiplexers:
    """A caller's multiplexed calls, one per (server, caller credential)."""

    def __init__(self) -> None:
        self._calls: dict[tuple[str, Metadata], Multiplexer] = {}
        # Calls of servers that left rotation, still ending their requests.
        self._retired: set[Multiplexer] = set()
        self._unsupported: set[str] = set()

    def supported(self, address: str) -> bool:
        """Whether ``address`` takes GenerateMultiplex (as far as the caller knows)."""
        return address not in self._unsupported

    def addresses(self) -> list[str]:
        """The servers with a multiplexed call open now."""
        return sorted({address for (address, _), mux in self._calls.items() if mux.alive})

    def open(
        self,
        address: str,
        channel: grpc.aio.Channel,
        request: data_plane_pb2.GenerateStreamRequest,
        metadata: Metadata,
        parsed: bool = False,
        call_metadata: Metadata | None = None,
    ) -> MuxStream:
        """``request`` (its session in ``metadata``) on ``address``'s call that carries
        ``call_metadata`` (None: the credential in ``metadata``), opened on ``channel`` if
        there is none."""
        session = session_of(metadata) or ""
        if call_metadata is None:
            call_metadata = tuple((k, v) for k, v in metadata if k == AUTHORIZATION)
        key = (address, call_metadata)
        mux = self._calls.get(key)
        if mux is None or not mux.alive:
            mux = self._calls[key] = Multiplexer(channel, call_metadata)
        return mux.open(request, session, parsed)

    def unsupported(self, address: str) -> None:
        """The server answered UNIMPLEMENTED: plain calls to it from now on."""
        if address not in self._unsupported:
            log.info("%s does not take GenerateMultiplex: streams go as their own calls", address)
        self._unsupported.add(address)

    def retire(self, address: str) -> None:
        """New streams to ``address`` open a new call; its calls now end once their requests
        have (a server leaving rotation, draining or lost, finishes or fails what it runs)."""
        for key in [k for k in self._calls if k[0] == address]:
            mux = self._calls.pop(key)
            mux.retire()
            self._retired.add(mux)
            mux.on_end(self._retired.discard)

    async def close(self) -> None:
        """Ends every call now (the caller stops)."""
        for mux in [*self._calls.values(), *self._retired]:
            await mux.close()
        self._calls.clear()
        self._retired.clear()


class WithFallback:
    """A multiplexed stream that becomes a plain call when the server turns out not to take
    GenerateMultiplex: UNIMPLEMENTED before anything arrived, or the transport's INTERNAL on a
    call the server never answered (the module's docstring: that may be UNIMPLEMENTED too)."""

    def __init__(
        self, stream: MuxStream, plain: Callable[[], Any], on_unsupported: Callable[[], None]
    ) -> None:
        self._upstream: Any = stream
        self._mux_stream = stream
        self._plain = plain
        self._on_unsupported = on_unsupported
        self._started = False

    def _settle_with_plain_call(self, error: grpc.aio.AioRpcError) -> bool:
        if self._started or self._upstream is not self._mux_stream:
            return False
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            self._on_unsupported()
            return True
        return (
            error.code() == grpc.StatusCode.INTERNAL
            and error.details() == TRANSPORT_BROKE
            and not self._mux_stream.call_answered
        )

    async def read(self) -> Any:
        try:
            message = await self._upstream.read()
        except grpc.aio.AioRpcError as error:
            if not self._settle_with_plain_call(error):
                raise
            self._upstream = self._plain()
            message = await self._upstream.read()
        self._started = True
        return message

    @property
    def tokens_read(self) -> int | None:
        """The tokens of the message ``read`` returned last (None: a plain call's, uncounted)."""
        return getattr(self._upstream, "tokens_read", None)

    def cancel(self) -> bool:
        return bool(self._upstream.cancel())

    def done(self) -> bool:
        return bool(self._upstream.done())
