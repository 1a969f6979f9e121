"""A server relaying a weight update down its relay plan: every frame of every stream it takes
from its parent in a relay tree goes on to each server below it in that tree
(``WeightRelayTree.children``) as it arrives, over that server's push socket or, where it has
none (TLS), its PushWeights, presenting that server's ticket for the update, this server's
name in the plan and the tree.

``Relays.stream(update, tree)`` forwards one stream (``RelayStream``, the ``Forwarding`` of
``peer_streams.stage_stream``); the connections to the servers below, one per tree a server
is below this one in, are opened at the tree's first stream and closed with the update. A
server below that cannot be reached, or goes away mid-stream, is a failure of that stream
(UNAVAILABLE, naming it); one that answers reports its own subtree. Each link sends from a
bounded queue of its own, so a slow server below slows the stream it relays (TCP's own pace),
never the others' or this server's staging beyond the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from servers.engine.domain.weights.relay_role import RelayRole, RelayTarget
from servers.engine.domain.weights.staging import OpenUpdate
from servers.engine.peers.peer_streams import Failure, PeerAccess
from skyrl_grpc.errors import call_status, status_of
from skyrl_grpc.metadata import PUSH_TICKET, RELAY_FAILURES, RELAY_TREE, RELAYED_FROM
from skyrl_grpc.names import PUSH_WEIGHTS
from skyrl_grpc.push_socket_client import PushSocketConnection, host_of
from skyrl_grpc.v1 import control_plane_pb2 as cp

log = logging.getLogger(__name__)

# Frames a link holds in flight beyond the one it sends: the stream's pace is the slowest
# link's once its queue is full.
LINK_QUEUE_FRAMES = 4
# Seconds a frame's send (or a stream's reply) may take before the server below counts as
# gone: as long as the trainer's own transfer may take.
RELAY_SEND_SECONDS = 600.0
_END = object()


def failures_of(address: str, reply: cp.PushSocketReply) -> list[Failure]:
    """What a stream's reply from ``address`` says failed below and at it."""
    if reply.relay_failures:
        return failures_from_proto(reply.relay_failures)
    if reply.code:
        status = status_of(reply.code)
        return [Failure(address, status, reply.message)]
    return []


def failures_from_proto(failures: Iterable[cp.RelayFailure]) -> list[Failure]:
    return [Failure(f.address, status_of(f.code), f.message) for f in failures]


def failures_to_proto(failures: list[Failure]) -> list[cp.RelayFailure]:
    return [
        cp.RelayFailure(address=f.address, code=f.code.value[0], message=f.message)
        for f in failures
    ]


class _Link:
    """The connection to one server below, for one update: a stream at a time."""

    def __init__(
        self, source: str, target: RelayTarget, access: PeerAccess, tree: int | None
    ) -> None:
        self.target = target
        self._source = source
        # The relay tree its streams travel down (None: the plan's one tree, unnamed).
        self._tree = tree
        self._access = access
        self._queue: asyncio.Queue[Any] = asyncio.Queue(LINK_QUEUE_FRAMES)
        self._sending: asyncio.Task[list[Failure]] | None = None
        # The push socket (opened at the first stream, in a thread of its own), or None.
        self._socket: PushSocketConnection | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._channel: grpc.aio.Channel | None = None
        self._broken: Failure | None = None
        # The update closed while a stream still went through: closed once that stream ends.
        self._retired = False

    def begin(self) -> None:
        self._queue = asyncio.Queue(LINK_QUEUE_FRAMES)
        self._sending = asyncio.ensure_future(self._send_stream())

    async def put(self, raw: bytes | memoryview) -> None:
        if self._sending is not None and not self._sending.done():
            await self._queue.put(raw)

    async def end(self) -> list[Failure]:
        if self._sending is None:
            return []
        if not self._sending.done():
            await self._queue.put(_END)
        return await self._sending

    def _failed(self, what: str, error: BaseException) -> list[Failure]:
        message = f"relay from {self._source} to {self.target.address}: {what}: {error}"
        self._broken = Failure(self.target.address, grpc.StatusCode.UNAVAILABLE, message)
        log.warning("%s", message)
        return [self._broken]

    async def _frames(self) -> Any:
        while (frame := await self._queue.get()) is not _END:
            yield frame

    async def _send_stream(self) -> list[Failure]:
        try:
            if self._broken is not None:
                return [self._broken]
            if self.target.push_socket_port:
                return await self._over_socket()
            return await self._over_grpc()
        finally:
            # Done with this stream, sent or not: what waits is dropped, which frees a forward
            # blocked on a full queue (later ones see the stream done and skip this link).
            self._drop_queue()
            if self._retired:
                self.close()

    async def _over_socket(self) -> list[Failure]:
        loop = asyncio.get_running_loop()
        try:
            if self._socket is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="relay")
                opened, hello = await loop.run_in_executor(self._thread, self._connect)
                self._socket = opened
                if hello.code:  # refused: so is every stream of this update
                    self._broken = failures_of(self.target.address, hello)[0]
                    return [self._broken]
            connection = self._socket
            async for frame in self._frames():
                await loop.run_in_executor(self._thread, connection.send, frame)
            reply = await loop.run_in_executor(self._thread, connection.end_stream)
        except (OSError, ValueError) as error:
            return self._failed("its push socket failed", error)
        return failures_of(self.target.address, reply)

    def _connect(self) -> tuple[PushSocketConnection, cp.PushSocketReply]:
        host = host_of(self.target.address)
        if host is None:
            raise ValueError(f"{self.target.address} is not host:port")
        port, ticket = self.target.push_socket_port, self.target.ticket
        return PushSocketConnection.connect(
            host, port, ticket, RELAY_SEND_SECONDS, self._source, self._tree
        )

    async def _over_grpc(self) -> list[Failure]:
        if self._channel is None:
            self._channel = self._access.channel(self.target.address)
        push: Any = self._channel.stream_unary(
            PUSH_WEIGHTS, request_serializer=None, response_deserializer=None
        )
        metadata: list[tuple[str, str | bytes]] = [
            *self._access.metadata,
            (PUSH_TICKET, self.target.ticket),
            (RELAYED_FROM, self._source),
            *([(RELAY_TREE, str(self._tree))] if self._tree is not None else []),
        ]

        async def messages() -> Any:
            async for frame in self._frames():
                yield bytes(frame)

        try:
            await push(messages(), metadata=metadata)
        except grpc.aio.AioRpcError as error:
            for key, value in error.trailing_metadata() or ():
                if key == RELAY_FAILURES and isinstance(value, bytes):
                    return failures_from_proto(cp.RelayFailures.FromString(value).failures)
            code, details = call_status(error)
            if code == grpc.StatusCode.UNAVAILABLE:
                return self._failed("its PushWeights failed", error)
            return [Failure(self.target.address, code, details)]
        return []

    def _drop_queue(self) -> None:
        """The link is done with this stream: what waits is dropped (and its sender freed)."""
        with contextlib.suppress(asyncio.QueueEmpty):
            while True:
                self._queue.get_nowait()

    def abort(self) -> None:
        """The stream is lost upstream: the server below sees its connection cut."""
        if self._sending is not None:
            self._sending.cancel()
        self.close()
        self._broken = Failure(
            self.target.address,
            grpc.StatusCode.UNAVAILABLE,
            f"relay from {self._source} to {self.target.address}: the stream was lost upstream",
        )

    def retire(self) -> None:
        """The update closed (committed, cancelled, rejected here): closed now, or once the
        stream going through ends (this server refused a stream whose rest it still relays,
        so each server below answers for itself)."""
        if self._sending is not None and not self._sending.done():
            self._retired = True
        else:
            self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()  # a send blocked in the thread fails at once
            self._socket = None
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None
        if self._channel is not None:
            channel, self._channel = self._channel, None
            with contextlib.suppress(RuntimeError):  # no loop: nothing to close it on
                asyncio.get_running_loop().create_task(channel.close())


class RelayStream:
    """One stream forwarded to every server below in its tree (``peer_streams.Forwarding``).
    Its links begin sending at its first message. A tree's streams come from one parent, one
    after another, so two streams never share a tree's links at once."""

    def __init__(self, links: list[_Link]) -> None:
        self._links = links
        self._begun = False

    async def forward(self, raw: bytes | memoryview) -> None:
        if not self._begun:
            self._begun = True
            for link in self._links:
                link.begin()
        await asyncio.gather(*(link.put(raw) for link in self._links))

    async def finish(self) -> list[Failure]:
        if not self._begun:
            return []  # nothing came: nothing to forward
        answers = await asyncio.gather(*(link.end() for link in self._links))
        return [failure for answer in answers for failure in answer]

    def abort(self) -> None:
        if self._begun:
            for link in self._links:
                link.abort()


class Relays:
    """The relay links of this server's open update, per relay tree it forwards in."""

    def __init__(self, access: PeerAccess) -> None:
        self._access = access
        self._links: dict[int, dict[int, list[_Link]]] = {}

    def stream(self, update: OpenUpdate, tree: int) -> RelayStream | None:
        """A stream of ``update`` forwarded down relay tree ``tree`` (None: this server
        forwards to nobody there)."""
        role: RelayRole | None = update.relay
        if role is None or not 0 <= tree < len(role.trees) or not role.trees[tree].children:
            return None
        key = id(update)
        trees = self._links.get(key)
        if trees is None:
            trees = self._links[key] = {}
            update.on_close.append(lambda: self._close(key))
        links = trees.get(tree)
        if links is None:
            named = tree if role.named else None
            links = trees[tree] = [
                _Link(role.address, target, self._access, named)
                for target in role.trees[tree].children
            ]
        return RelayStream(links)

    def _close(self, key: int) -> None:
        for links in self._links.pop(key, {}).values():
            for link in links:
                link.retire()
