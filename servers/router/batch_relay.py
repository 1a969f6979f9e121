"""GenerateBatch through the router: a batch split by placement, sent to each server as one
batched call, the servers' streams merged back into one.

Each request of the batch is placed as a GenerateStream call with its session would be
(``BackendPool.choose``: a session's requests go to its server, bounded load holds, and each
placed request counts as in flight there); each server gets its part under the caller's own
indices (``GenerateBatchRequest.indices``), so its answers are relayed as bytes, unread. What
has waited while the caller was slow is sent as one message: serialized protobuf messages
concatenated are one message whose repeated fields hold both's entries.

A server lost mid-batch (its call fails UNAVAILABLE, or it reports a request UNAVAILABLE) moves
its unfinished requests as GenerateStream calls move (``StreamMigration``): its answers so far
are read then (never before), each request continues on another server from the prompt plus
its tokens so far (``skyrl_grpc.continuation``) on a server at least as new as those tokens'
weights, and the continuation's chunks are rewritten so
the caller reads one uninterrupted request. A request that cannot move (several samples, a
constrained output past its first token, no moves left) ends with its own UNAVAILABLE error.
A server cut off rather than dead still runs the requests it lost: where a moved request comes
back to it and it refuses the caller's request id ALREADY_EXISTS, the router aborts that orphan
there and sends the request again (``ProxyOptions.max_orphan_aborts`` times at most), as it does
for a stream (``migration.abort_orphan``).
Where no member serves (all lost at once), the batch, or its requests that move, are held
until one serves again (``holds.CallHolds``) before they are placed.
A server's refusal of the whole call (a bad token, a malformed batch) ends the call with that
status while nothing was sent yet, and otherwise becomes an error of each of its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import cast

import grpc

from servers.common.grpc_types import Context
from servers.common.interceptors import abort_with_status
from servers.router.backends import Backend
from servers.router.migration import abort_orphan
from servers.router.proxy import Proxy, forwarded_metadata
from servers.router.upstreams import Metadata
from skyrl_grpc.batch_shape import batch_shape
from skyrl_grpc.continuation import continue_request, resumable
from skyrl_grpc.errors import InvalidArgument, SkyrlError, Unavailable, call_status
from skyrl_grpc.metadata import SESSION_ID
from skyrl_grpc.names import GENERATE_BATCH
from skyrl_grpc.v1 import data_plane_pb2

log = logging.getLogger(__name__)

# Statuses that refuse a whole call for a reason of the caller's, not of its requests.
_CALL_REFUSALS = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
}


@dataclass
class _Request:
    """One request of the batch as the router tracks it."""

    index: int
    request: data_plane_pb2.GenerateStreamRequest
    session: str
    # The request as first sent: continuations are built from it.
    original: data_plane_pb2.GenerateStreamRequest = field(init=False)
    # What its lost servers sent of it, read once they were lost: its (single) sample's
    # tokens, how many samples finished, whether it ended (finished or failed).
    tokens: list[int] = field(default_factory=list)
    finished_samples: int = 0
    version: int = 0  # the newest weight version of its tokens
    experts_rows: int = 0  # rows of routed experts its chunks carried (a continuation's start)
    done: bool = False
    sent_chunks: bool = False  # the caller has had a chunk of it (and its request id)
    retries: int = 0  # moves before anything of it was sent
    migrations: int = 0  # moves after
    # Runs as a continuation after ``base`` tokens: its chunks are rewritten to count from
    # the original prompt.
    continued: bool = False
    base: int = 0
    tried: set[str] = field(default_factory=set)
    # The servers it was lost from (one may still run it: an orphan), and the orphans aborted.
    lost_from: set[str] = field(default_factory=set)
    orphan_aborts: int = 0

    def __post_init__(self) -> None:
        self.original = self.request
        self.version = self.request.min_weight_version

    @property
    def samples(self) -> int:
        return max(self.original.n, 1)


@dataclass(eq=False)
class _Part:
    """The part of the batch sent to one server, as one GenerateBatch call."""

    backend: Backend
    requests: list[_Request]
    backlog: list[bytes] = field(default_factory=list)  # its answers, read only if it is lost
    task: asyncio.Task[None] | None = None
    # Its answers are read as they come (set once it is placed; its requests' moves are made
    # before): a request runs as a continuation, or may meet an orphan of its own there.
    reads_answers: bool = False


class BatchRelay:
    """One GenerateBatch call through the router (see the module docstring)."""

    def __init__(self, proxy: Proxy, request: bytes, context: Context) -> None:
        self._proxy = proxy
        self._context = context
        self._metadata: Metadata = tuple(
            (k, v) for k, v in forwarded_metadata(context) if k != SESSION_ID
        )
        self._raw = request
        self._requests: dict[int, _Request] = {}
        self._queue: asyncio.Queue[tuple[_Part, bytes | BaseException | None]] = asyncio.Queue()
        self._parts: set[_Part] = set()
        self._sent = False  # something reached the caller
        # Requests a server refused as orphans of their own (their id still runs there).
        self._orphans: list[tuple[Backend, _Request]] = []

    def _read_request(self) -> None:
        try:
            batch = data_plane_pb2.GenerateBatchRequest.FromString(self._raw)
        except Exception as error:
            raise InvalidArgument(f"router: the batch does not decode: {error}") from error
        indices, sessions = batch_shape(batch)
        for index, request, session in zip(indices, batch.requests, sessions, strict=True):
            self._requests[index] = _Request(index, request, session)

    # -- sending ------------------------------------------------------------------------------

    async def _held(self, requests: list[_Request]) -> bool:
        """``CallHolds.hold``: whether it waited for a member to serve again (one new enough
        for each of ``requests``) and one does; a wait in vain leaves each request's own error
        to ``_place``."""
        floor = max((r.request.min_weight_version for r in requests), default=0)
        try:
            return await self._proxy.holds.hold(self._context, floor)
        except Unavailable:
            return False

    def _place(self, requests: list[_Request]) -> list[bytes]:
        """Sends ``requests`` to the servers placement picks, a call per server; returns the
        errors of those no server could take."""
        parts: dict[str, _Part] = {}
        failed = []
        for request in requests:
            try:
                backend = self._proxy.pick(
                    request.session or None, request.tried, request.request.min_weight_version
                )
            except SkyrlError as error:
                request.done = True
                failed.append(_errors((request.index, error.code, str(error))))
                continue
            request.tried.add(backend.address)
            self._proxy.begin(backend, GENERATE_BATCH)
            part = parts.get(backend.address)
            if part is None:
                part = parts[backend.address] = _Part(backend, [])
            part.requests.append(request)
        for part in parts.values():
            address = part.backend.address
            part.reads_answers = any(
                r.continued or (address in r.lost_from and r.original.request_id)
                for r in part.requests
            )
            self._parts.add(part)
            part.task = asyncio.ensure_future(self._read(part))
        return failed

    async def _read(self, part: _Part) -> None:
        """Relays one part's answers into the shared queue, then its end (None or error)."""
        message = data_plane_pb2.GenerateBatchRequest(
            requests=[r.request for r in part.requests],
            session_ids=[r.session for r in part.requests],
            indices=[r.index for r in part.requests],
        )
        method: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = part.backend.channel.unary_stream(
            GENERATE_BATCH
        )
        call = method(
            message.SerializeToString(),
            timeout=self._context.time_remaining(),
            metadata=self._metadata,
        )
        try:
            while (raw := await call.read()) is not grpc.aio.EOF:
                self._queue.put_nowait((part, cast(bytes, raw)))
        except grpc.aio.AioRpcError as error:
            self._queue.put_nowait((part, error))
            return
        finally:
            if not call.done():
                call.cancel()
        self._queue.put_nowait((part, None))

    # -- receiving ----------------------------------------------------------------------------

    def _forward(self, part: _Part, raw: bytes) -> bytes:
        """What to send the caller of a part's answer: as it is, or rewritten where a request
        runs as a continuation, or refused as its own orphan (taken out: ``_orphans``). A part
        that may be lost keeps its answers to read then."""
        if not part.reads_answers:
            part.backlog.append(raw)
            return raw
        message = data_plane_pb2.GenerateBatchResponse.FromString(raw)
        orphans = [e for e in message.errors if self._is_orphan(part, e)]
        for error in orphans:
            message.errors.remove(error)
            request = self._requests[error.index]
            part.requests.remove(request)  # the part's call goes on without it
            self._proxy.end(part.backend, False)
            self._orphans.append((part.backend, request))
        for chunk in message.chunks:
            request = self._requests[chunk.batch_index]
            if request.continued:
                chunk.usage.prompt_tokens = len(request.original.prompt_token_ids)
                chunk.usage.completion_tokens = request.base + chunk.usage.completion_tokens
                chunk.ClearField("prompt_logprobs")
                if request.sent_chunks:
                    chunk.ClearField("request_id")
        forwarded = message.SerializeToString()
        part.backlog.append(forwarded)
        return forwarded

    def _is_orphan(self, part: _Part, error: data_plane_pb2.BatchError) -> bool:
        """A request refused ALREADY_EXISTS by a server it was lost from, under the caller's own
        id, with aborts left: that server still runs it."""
        request = self._requests[error.index]
        return (
            error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
            and part.backend.address in request.lost_from
            and bool(request.original.request_id)
            and request.orphan_aborts < self._proxy.options.max_orphan_aborts
        )

    async def _send_orphans_again(self) -> list[bytes]:
        """Each orphan aborted on its server, its request sent again (to the same server, as
        placement keeps its session there); returns the errors of those no server took."""
        orphans, self._orphans = self._orphans, []
        for backend, request in orphans:
            await abort_orphan(backend.channel, request.original.request_id, self._metadata)
        backoff = max(r.orphan_aborts for _, r in orphans)
        await asyncio.sleep(self._proxy.options.retry_backoff_seconds * 2**backoff)
        for backend, request in orphans:
            request.orphan_aborts += 1
            request.tried.discard(backend.address)
        return self._place([request for _, request in orphans])

    def _lost(self, part: _Part, why: str) -> tuple[list[_Request], list[bytes]]:
        """A part's server is gone: its answers so far read, its unfinished requests either
        to move (returned) or failed (their errors returned)."""
        self._proxy.pool.mark_unavailable(part.backend)
        _apply(part.backlog, self._requests)
        moving, errors = [], []
        for request in part.requests:
            if request.done:
                continue
            request.lost_from.add(part.backend.address)
            if self._may_move(request):
                if request.sent_chunks:
                    request.migrations += 1
                    request.request = continue_request(
                        request.original, request.tokens, request.version, request.experts_rows
                    )
                    request.continued = True
                    request.base = len(request.tokens)
                else:
                    request.retries += 1
                moving.append(request)
            else:
                request.done = True
                errors.append(
                    _errors(
                        (
                            request.index,
                            grpc.StatusCode.UNAVAILABLE,
                            f"router: backend {part.backend.address} was lost mid-batch "
                            f"({why}); this request cannot move on ({self._why_not(request)})",
                        )
                    )
                )
        return moving, errors

    def _may_move(self, request: _Request) -> bool:
        """Before anything of it reached the caller: a plain retry, within ``max_retries``.
        After: a single sample whose output can continue, within ``max_migrations``."""
        options = self._proxy.options
        if not request.sent_chunks:
            return request.retries < options.max_retries
        return (
            request.samples == 1
            and request.migrations < options.max_migrations
            and resumable(request.original)
        )

    def _why_not(self, request: _Request) -> str:
        if not request.sent_chunks:
            return "no retries left (the router's max_retries)"
        if request.samples > 1:
            return "it has several samples"
        if not resumable(request.original):
            return "its output is constrained and has begun"
        return "no migrations left (--max-migrations)"

    def _end_part(self, part: _Part, failed: bool) -> None:
        self._parts.discard(part)
        for _ in part.requests:
            self._proxy.end(part.backend, failed)

    async def relay(self) -> AsyncGenerator[bytes, None]:
        """The merged stream of the caller's call."""
        try:
            self._read_request()
            requests = list(self._requests.values())
            await self._held(requests)
            for error in self._place(requests):
                yield error
            while self._parts:
                item = [await self._queue.get()]
                while not self._queue.empty():
                    item.append(self._queue.get_nowait())
                out: list[bytes] = []
                for part, event in item:
                    if isinstance(event, bytes):
                        out.append(self._forward(part, event))
                    elif event is None:
                        self._end_part(part, failed=False)
                    else:
                        out.extend(await self._failed(part, event))
                if self._orphans:
                    out.extend(await self._send_orphans_again())
                out = [raw for raw in out if raw]
                if out:
                    self._sent = True
                    yield b"".join(out)
        except SkyrlError as error:
            await abort_with_status(error, self._context, GENERATE_BATCH)
        finally:
            for part in list(self._parts):
                if part.task is not None:
                    part.task.cancel()
                self._end_part(part, failed=True)

    async def _failed(self, part: _Part, error: BaseException) -> list[bytes]:
        """A part's call ended with an error: its requests move, or end with errors."""
        self._end_part(part, failed=True)
        code, details = (
            call_status(error) if isinstance(error, grpc.aio.AioRpcError) else (None, str(error))
        )
        if code == grpc.StatusCode.UNAVAILABLE:
            moving, errors = self._lost(part, details or "unavailable")
            if moving:
                log.warning(
                    "moving %d requests of a batch from lost backend %s",
                    len(moving),
                    part.backend.address,
                )
                await asyncio.sleep(self._proxy.options.retry_backoff_seconds)
                if await self._held(moving):  # the one back may be one tried before
                    for request in moving:
                        request.tried.clear()
                errors += self._place(moving)
            return errors
        if code in _CALL_REFUSALS and not self._sent and not part.backlog:
            assert isinstance(error, grpc.aio.AioRpcError)
            await self._context.abort(error.code(), error.details() or "")
        _apply(part.backlog, self._requests)
        failed = [r for r in part.requests if not r.done]
        for request in failed:
            request.done = True
        status = code or grpc.StatusCode.INTERNAL
        return [_errors(*((r.index, status, f"{part.backend.address}: {details}") for r in failed))]


def _apply(backlog: list[bytes], requests: dict[int, _Request]) -> None:
    """A lost part's answers, read at last: each request's tokens, ends and errors so far."""
    for raw in backlog:
        message = data_plane_pb2.GenerateBatchResponse.FromString(raw)
        for chunk in message.chunks:
            request = requests[chunk.batch_index]
            request.sent_chunks = True
            if request.samples == 1:
                request.tokens.extend(chunk.token_ids)
                request.experts_rows += chunk.routed_experts.tokens
                if chunk.token_ids:
                    request.version = max(request.version, chunk.weight_version)
            if chunk.finish_reason:
                request.finished_samples += 1
                if request.finished_samples >= request.samples:
                    request.done = True
        for error in message.errors:
            requests[error.index].done = True
    backlog.clear()


def _errors(*failures: tuple[int, grpc.StatusCode, str]) -> bytes:
    """Errors of requests as one GenerateBatchResponse, serialized."""
    return data_plane_pb2.GenerateBatchResponse(
        errors=[
            data_plane_pb2.BatchError(index=index, code=code.value[0], message=message)
            for index, code, message in failures
        ]
    ).SerializeToString()


async def relay_batch(proxy: Proxy, request: bytes, context: Context) -> AsyncIterator[bytes]:
    """The handler of GenerateBatch on the router."""
    async with contextlib.aclosing(BatchRelay(proxy, request, context).relay()) as relayed:
        async for message in relayed:
            yield message
