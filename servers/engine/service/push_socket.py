"""The push socket: PushWeights' streams on a plain TCP connection, beside the gRPC port.

gRPC's Python runtime costs several times a link's time for an update's gigabytes (HTTP/2
framing, a message object per chunk, on both ends); on this socket the same serialized
``PushWeightsRequest`` messages travel as length-prefixed frames (``skyrl_grpc.socket_frames``),
each read whole, in one system call, by a thread of the connection's own while the event loop
checks and stages the frame before it. What the frames carry goes the way a PushWeights
call's messages go (``weight_streams``): the same checks, the same relaying, the same staging,
the same errors, answered per stream as the status PushWeights would have ended with
(``PushSocketReply``).

A connection first presents the ticket of the update it streams into (the trainer got it from
StartWeightUpdate over the authenticated control channel, or chose it; a relaying server got
it in its relay role) and, relayed, the peer it comes from: it may push into that update and
no other. The socket is not encrypted; a server serving TLS does not open it (its peers relay
to it over gRPC). The wire is ``PushSocketHello`` in control_plane.proto.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from google.protobuf.message import DecodeError

from servers.common.interceptors import CallCounter, status_of
from servers.engine.peers.peer_streams import StreamOutcome
from servers.engine.peers.stream_items import push_item
from servers.engine.service.frame_buffers import FrameBuffers
from servers.engine.service.weight_streams import Messages, socket_reply
from servers.engine.transfer.specs import Manifest
from skyrl_grpc.chunk_wire import WireChunk, decode_push_request
from skyrl_grpc.errors import InvalidArgument, SkyrlError
from skyrl_grpc.socket_frames import FrameTooLarge, recv_frame, send_frame
from skyrl_grpc.v1 import control_plane_pb2 as cp

log = logging.getLogger(__name__)


class Streams(Protocol):
    """Where a connection's streams go (``weight_streams.WeightStreams``)."""

    def check_sender(self, ticket: bytes | None, relayed_from: str, tree: int | None) -> None: ...

    async def stage(
        self, ticket: bytes | None, relayed_from: str, tree: int | None, messages: Messages
    ) -> tuple[StreamOutcome, str]: ...


# A hello is a ticket: anything longer is not one.
HELLO_LIMIT = 1024
# A connection silent this long is closed (its trainer's machine died without closing it).
IDLE_SECONDS = 600.0


class PushSocketServer:
    """Accepts push socket connections on ``host:port`` (0: any free port) and serves each."""

    def __init__(
        self,
        host: str,
        port: int,
        streams: Streams,
        max_frame_bytes: int,
        calls: CallCounter | None = None,
    ) -> None:
        self._streams = streams
        # Counts each stream as a call in progress: a draining server lets it finish, as it
        # does a PushWeights call.
        self._calls = calls or CallCounter()
        self._max_frame_bytes = max_frame_bytes
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(16)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._connections: set[asyncio.Task[None]] = set()
        self._accepting: asyncio.Task[None] | None = None
        # Streams staged through this socket since the server started.
        self.streams_staged = 0
        # Memory frames are read into, reused once staged (every connection's).
        self.buffers = FrameBuffers()

    def start(self) -> None:
        self._accepting = asyncio.create_task(self._accept(), name="push socket")

    async def close(self) -> None:
        """Stops accepting and ends every connection (a stream in progress is abandoned, as
        a PushWeights call is when its server stops)."""
        tasks = [t for t in (self._accepting, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listener.close()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            connection, peer = await loop.sock_accept(self._listener)
            task = asyncio.create_task(self._serve(connection), name=f"push socket {peer}")
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, connection: socket.socket) -> None:
        connection.setblocking(True)
        connection.settimeout(IDLE_SECONDS)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Its own thread: a connection's blocking reads never hold a thread others need.
        executor = ThreadPoolExecutor(1, thread_name_prefix="push-socket")
        frames = _Frames(connection, executor, self._max_frame_bytes, self.buffers.take)
        try:
            sender = await self._hello(frames)
            if sender is None:
                return
            while await frames.stream_begins():
                self._calls.begin()
                try:
                    await frames.send(await self._stream(*sender, frames))
                finally:
                    self._calls.end()
        except FrameTooLarge as error:  # the rest of the connection cannot be framed: closed
            refusal = InvalidArgument(f"{error}: send smaller chunks or raise --max-message-mib")
            with contextlib.suppress(OSError):
                await frames.send(_error_reply(refusal))
        except OSError as error:  # the peer went away
            log.info("push socket connection closed: %s", error)
        finally:
            frames.close()
            executor.shutdown(wait=False)

    async def _hello(self, frames: _Frames) -> tuple[bytes, str, int | None] | None:
        """The connection's ticket, who relays it ("": the trainer) and down which relay tree
        (None: none named), or None when it is refused (the reply says why)."""
        frame = await frames.next(HELLO_LIMIT)
        if frame is None:
            return None
        try:
            hello = cp.PushSocketHello.FromString(bytes(frame))
            tree = hello.relay_tree if hello.HasField("relay_tree") else None
            self._streams.check_sender(hello.ticket, hello.relayed_from, tree)
        except (DecodeError, SkyrlError) as error:
            refusal = error if isinstance(error, SkyrlError) else _not_a_hello(error)
            await frames.send(_error_reply(refusal))
            return None
        await frames.send(cp.PushSocketReply())
        return hello.ticket, hello.relayed_from, tree

    async def _stream(
        self, ticket: bytes, relayed_from: str, tree: int | None, frames: _Frames
    ) -> cp.PushSocketReply:
        """One stream staged (and relayed), or refused (its remaining frames read and dropped
        first, so the connection is ready for the next stream): the reply either way."""
        try:
            outcome, address = await self._streams.stage(
                ticket, relayed_from, tree, _messages(frames)
            )
        except (OSError, FrameTooLarge):
            raise  # the peer went away, or the connection cannot be framed: ``_serve`` ends it
        except Exception as error:
            await frames.skip_stream()
            return _error_reply(error)
        if outcome.error is not None:
            await frames.skip_stream()  # read already where it was relayed
        else:
            self.streams_staged += 1
        return socket_reply(outcome, address)


async def _messages(
    frames: _Frames,
) -> AsyncIterator[tuple[memoryview, Manifest | WireChunk]]:
    """A stream's frames, each with its message as the assembler takes it, until its empty end
    frame."""
    while (frame := await frames.next()) is not None and len(frame):
        try:
            message = decode_push_request(frame)
        except DecodeError as error:
            raise InvalidArgument(
                f"a push socket frame is not a serialized PushWeightsRequest: {error}"
            ) from None
        yield frame, push_item(message)
    if frame is None:
        raise ConnectionError("the push socket closed in the middle of a stream")


class _Frames:
    """A connection's frames, read in its thread one ahead of the one being handled (within a
    stream), so the next frame arrives while this one is checked and staged."""

    def __init__(
        self,
        sock: socket.socket,
        executor: ThreadPoolExecutor,
        limit: int,
        allocate: Callable[[int], memoryview],
    ) -> None:
        self._sock = sock
        self._executor = executor
        self._limit = limit
        self._allocate = allocate
        self._ahead: asyncio.Future[memoryview | None] | None = None
        # Whether the last frame handed out ended a stream (or no stream began yet).
        self._between_streams = True

    def _read(self, limit: int) -> asyncio.Future[memoryview | None]:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, recv_frame, self._sock, limit, self._allocate)

    async def next(self, limit: int | None = None) -> memoryview | None:
        """The next frame (None: the peer closed the connection)."""
        ahead, self._ahead = self._ahead, None
        frame = await (ahead or self._read(limit or self._limit))
        self._between_streams = frame is None or not len(frame)
        if not self._between_streams and limit is None:
            self._ahead = self._read(self._limit)
        return frame

    async def stream_begins(self) -> bool:
        """Waits for the next stream's first frame; False if the peer closed instead."""
        self._ahead = self._read(self._limit)
        with contextlib.suppress(ConnectionError):
            if await asyncio.shield(self._ahead) is not None:
                self._between_streams = False  # skip_stream reads from its first frame on
                return True
        return False

    async def skip_stream(self) -> None:
        """Reads and drops the rest of the current stream."""
        while not self._between_streams:
            await self.next()

    async def send(self, reply: cp.PushSocketReply) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            self._executor, send_frame, self._sock, reply.SerializeToString()
        )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked in the thread
        self._sock.close()
        if self._ahead is not None:  # a read ahead now fails: nobody waits for it
            self._ahead.add_done_callback(lambda read: read.cancelled() or read.exception())


def _error_reply(error: BaseException) -> cp.PushSocketReply:
    """The status PushWeights would have ended with, as a reply."""
    code, message = status_of(error, "a push socket stream")
    return cp.PushSocketReply(code=code.value[0], message=message)


def _not_a_hello(error: DecodeError) -> SkyrlError:
    return InvalidArgument(f"the push socket's first frame is not a PushSocketHello: {error}")
