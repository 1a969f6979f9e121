"""The proxy: every DataPlane call forwarded to one backend as raw bytes, along one path.

The router never decodes a payload it does not need (so contract additions need no router
change): a generic handler relays request and response messages, all metadata
(``x-session-id``, auth, tracing), the deadline and the final status. Every call, whatever its
shape, takes the same path (``Proxy.relay``): pick a backend (``BackendPool.choose``), count it
in flight, read its first message, announce the backend in the ``x-skyrl-backend`` header,
relay the rest, count it out. A call that fails UNAVAILABLE before any message of its upstream
reached the caller is retried on another backend (bounded, with backoff) when its request can
be sent again; a GenerateStream cut mid-way by a lost backend migrates (``migration``). A call
that finds no member serving (every one lost at once: a partition, the router's own link) is
held until one serves again, up to ``hold_seconds`` and its deadline (``holds``), instead
of failing at once. Abort and FinishSession are the exceptions: they go to every backend
(``Proxy.everywhere``).
Errors of the router's own go through ``skyrl_grpc.errors`` and the shared status mapping;
a backend's status is passed through as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc

from servers.common.early_answer import read_rest
from servers.common.grpc_types import Context
from servers.common.interceptors import abort_with_status
from servers.router.backends import Backend, BackendPool
from servers.router.fleet_view import FleetEvents
from servers.router.holds import CallHolds, no_backend_reason
from servers.router.metrics import RouterMetrics
from servers.router.migration import StreamMigration, abort_orphan, floor_of
from servers.router.upstreams import (
    Metadata,
    Starter,
    StreamMeter,
    Upstream,
    start_server_stream,
    start_unary,
)
from skyrl_grpc import tracing
from skyrl_grpc.errors import SkyrlError, Unavailable, call_status, server_lost
from skyrl_grpc.metadata import ROUTED_TO, session_of
from skyrl_grpc.multiplex import Multiplexers, WithFallback
from skyrl_grpc.names import ABORT, FINISH_SESSION, GENERATE_STREAM
from skyrl_grpc.v1 import data_plane_pb2

log = logging.getLogger(__name__)

# Metadata the transport owns; everything else is forwarded as is.
_NOT_FORWARDED = ("grpc-", ":")
_NOT_FORWARDED_KEYS = {"user-agent", "te", "content-type"}


def forwarded_metadata(context: Context) -> Metadata:
    return tuple(
        (key, value)
        for key, value in (context.invocation_metadata() or ())
        if not key.startswith(_NOT_FORWARDED) and key not in _NOT_FORWARDED_KEYS
    )


@dataclass
class ProxyOptions:
    max_retries: int = 2  # extra backends to try for a call that failed before any response
    retry_backoff_seconds: float = 0.05
    # How often one GenerateStream may move to another backend when its backend dies (0: off).
    max_migrations: int = 2
    # When every healthy backend is paused: answer UNAVAILABLE at once instead of sending the
    # call to wait for Resume (up to its deadline).
    fail_when_paused: bool = False
    # GenerateStream calls share one GenerateMultiplex call per server (False: a call each).
    multiplex: bool = True
    # Times a moved stream aborts its request left running on the server it was lost from
    # (cut off, not dead: it did not see the stream end) and sends its continuation there
    # again, which that server refused ALREADY_EXISTS meanwhile.
    max_orphan_aborts: int = 5
    # How long a call that finds no member serving waits for one to serve again (a stream
    # whose server was lost waits so too, then moves there), within its deadline; 0: it
    # fails UNAVAILABLE at once. A fleet whose every server the router lost together (its own
    # link flapping, a partition, a rack's switch rebooting) is back in seconds.
    hold_seconds: float = 10.0


@dataclass
class Proxy:
    """Forwards calls to the backend ``pool.choose`` picks."""

    pool: BackendPool
    metrics: RouterMetrics
    options: ProxyOptions = field(default_factory=ProxyOptions)
    # GenerateStream calls travel over one multiplexed call per server (``multiplex``).
    multiplexers: Multiplexers = field(default_factory=Multiplexers)
    # What happened to the fleet lately (migrations here; the router adds health changes).
    events: FleetEvents = field(default_factory=FleetEvents)
    # Calls held while no member serves (``holds.hold``), built beside the pool.
    holds: CallHolds = field(init=False)

    def __post_init__(self) -> None:
        self.holds = CallHolds(self.pool, self.metrics, lambda: self.options.hold_seconds)

    @property
    def holding(self) -> int:
        """Calls held now while no member serves."""
        return self.holds.holding

    def _start_generation(
        self,
        backend: Backend,
        request: bytes | data_plane_pb2.GenerateStreamRequest,
        metadata: Metadata,
        timeout: float | None,
        parsed: bool = False,
    ) -> Upstream:
        """A GenerateStream on ``backend``: over its multiplexed call where it takes one
        (``parsed``: its chunks read as chunks, where the multiplexed call has them so)."""
        address = backend.address

        def plain() -> Upstream:
            raw = request if isinstance(request, bytes) else request.SerializeToString()
            return start_server_stream(GENERATE_STREAM, backend, raw, metadata, timeout)

        if not self.options.multiplex or not self.multiplexers.supported(address):
            return plain()
        if isinstance(request, bytes):
            try:
                request = data_plane_pb2.GenerateStreamRequest.FromString(request)
            except Exception:
                return plain()  # the server will say what is wrong with it
        stream = self.multiplexers.open(address, backend.channel, request, metadata, parsed)
        return WithFallback(stream, plain, lambda: self.multiplexers.unsupported(address))

    def pick(self, session: str | None, tried: set[str], min_version: int = 0) -> Backend:
        """The backend for a call, serving ``min_version`` or newer (UNAVAILABLE, saying why,
        when there is none)."""
        home = self.pool.placement.sessions.home(session) if session else None
        backend = self.pool.choose(session, frozenset(tried), min_version)
        if backend is not None:
            decision = (
                "load"
                if not session
                else "session_home"
                if home == backend.address
                else "session_placed"
            )
            self.metrics.decisions.labels(backend.address, decision).inc()
            if (
                backend.paused
                and self.options.fail_when_paused
                and all(b.paused for b in self.pool.serving())
            ):
                raise Unavailable(
                    "router: every healthy backend is paused (a weight update?): retry after "
                    "they resume; this router fails fast instead of waiting (--fail-when-paused)"
                )
            return backend
        raise Unavailable(f"router: {no_backend_reason(self.pool, tried, min_version)}")

    async def _pick_or_hold(
        self, session: str | None, tried: set[str], context: Context, min_version: int = 0
    ) -> Backend:
        """``pick``, or where no member serves (``min_version`` or newer), ``pick`` once
        ``hold`` saw one serve (a backend tried before may be it: it came back)."""
        try:
            return self.pick(session, tried, min_version)
        except Unavailable:
            if not await self.holds.hold(context, min_version):
                raise
        return self.pick(session, set(), min_version)

    def _may_retry(self, error: grpc.aio.AioRpcError, retries: int) -> bool:
        return server_lost(error) and retries < self.options.max_retries

    async def relay(
        self,
        method: str,
        request: Any,
        context: Context,
        start: Starter,
        *,
        replayable: bool = True,
        migration: StreamMigration | None = None,
        unread: AsyncIterator[bytes] | None = None,
        parse: Callable[[bytes], Any] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """The one forwarding path; yields the upstream's messages for the caller.

        ``request``: what ``start`` sends (bytes, or a message it serializes only if it must).
        ``replayable``: the request may be sent to another backend after a failure (not when
        the caller streams it). ``unread``: the caller's request stream, read to its end before
        an error status is sent (otherwise a caller still sending sees a transport error
        instead of the status that explains it). ``parse``: the caller (in this process) takes
        messages, not bytes: an upstream's bytes go through it (a multiplexed stream hands
        its chunks over as they are).
        """
        metadata = forwarded_metadata(context)
        session = session_of(metadata)
        # Tracing on: this call's span (its caller's child), passed on to the backend.
        traced = contextlib.ExitStack()
        span = None
        if tracing.enabled():
            span = traced.enter_context(tracing.server_span(method, metadata))
            metadata = tracing.with_context(metadata)
        tried: set[str] = set()
        retries = orphan_aborts = 0
        headers_sent = False
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        worker = ""
        meter = StreamMeter(self.metrics, started) if method == GENERATE_STREAM else None
        asked_floor = 0 if migration else floor_of(method, request)  # read once, not per try
        try:
            while True:
                floor = migration.min_version if migration else asked_floor
                backend = await self._pick_or_hold(session, tried, context, floor)
                worker = backend.address
                tried.add(backend.address)
                self.begin(backend, method)
                failed = True
                upstream = start(backend, request, metadata, context.time_remaining())
                try:
                    try:
                        message = await upstream.read()
                    except grpc.aio.AioRpcError as error:
                        orphan = None if migration is None else migration.orphaned_on(worker)
                        if (
                            orphan is not None
                            and error.code() == grpc.StatusCode.ALREADY_EXISTS
                            and orphan_aborts < self.options.max_orphan_aborts
                        ):
                            await abort_orphan(backend.channel, orphan, metadata)
                            await asyncio.sleep(
                                self.options.retry_backoff_seconds * 2**orphan_aborts
                            )
                            orphan_aborts += 1
                            tried.discard(worker)  # the continuation goes there again
                            continue
                        # Nothing of this upstream reached the caller: safe to try elsewhere.
                        if not (replayable and self._may_retry(error, retries)):
                            raise
                        if migration is not None and server_lost(error):
                            migration.lost_unanswered(worker)
                        self.pool.mark_unavailable(backend)
                        self.metrics.retries.labels(method).inc()
                        await asyncio.sleep(self.options.retry_backoff_seconds * 2**retries)
                        retries += 1
                        continue
                    if not headers_sent:
                        await context.send_initial_metadata(((ROUTED_TO, backend.address),))
                        headers_sent = True
                    try:
                        while message is not grpc.aio.EOF:
                            if parse is not None and isinstance(message, bytes):
                                message = parse(message)
                            if meter is not None:
                                meter.observe(worker, upstream, message)
                            yield message if migration is None else migration.observe(message)
                            message = await upstream.read()
                    except grpc.aio.AioRpcError as error:
                        if not server_lost(error):
                            raise
                        self.pool.mark_unavailable(backend)
                        if migration is None or not migration.can_migrate():
                            why = "migration is off" if migration is None else "no migrations left"
                            raise Unavailable(
                                f"router: backend {backend.address} was lost mid-stream "
                                f"({call_status(error)[1]}); {why}"
                            ) from error
                        request = migration.continuation(backend.address)
                        self.metrics.migrations.labels(method).inc()
                        self.events.record("migration", backend.address, "a stream moved")
                        log.warning("migrating a stream from lost backend %s", backend.address)
                        continue
                    failed = False
                    return
                finally:
                    if not upstream.done():
                        upstream.cancel()  # the caller went away: stop the work upstream
                    self.end(backend, failed)
        except grpc.aio.AioRpcError as error:
            code, details = call_status(error)
            if unread is not None:
                await read_rest(unread)
            await context.abort(code, details, tuple(error.trailing_metadata() or ()))
        except SkyrlError as error:
            code = error.code
            if unread is not None:
                await read_rest(unread)
            await abort_with_status(error, context, method)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self._finish(method, code, started, worker)
            if code != grpc.StatusCode.OK:
                tracing.failed(span, code.name, f"ended {code.name} on {worker or 'no backend'}")
            traced.close()

    async def everywhere(self, method: str, request: bytes, context: Context) -> list[bytes]:
        """Sends a unary call to every backend at once; returns the answers of those that
        answered. Fails only if none did: with their common status when they all gave the
        same one (e.g. INVALID_ARGUMENT, the request's own fault), else UNAVAILABLE."""
        metadata = forwarded_metadata(context)
        backends = self.pool.backends
        started = time.perf_counter()
        if not backends:
            self._finish(method, grpc.StatusCode.UNAVAILABLE, started)
            await abort_with_status(Unavailable("router: it has no backends"), context, method)
        timeout = context.time_remaining()

        async def send(backend: Backend) -> bytes:
            call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = backend.channel.unary_unary(
                method
            )
            self.metrics.requests.labels(method, backend.address).inc()
            return await call(request, timeout=timeout, metadata=metadata)

        outcomes = await asyncio.gather(*(send(b) for b in backends), return_exceptions=True)
        answers = [o for o in outcomes if isinstance(o, bytes)]
        errors = [
            (b.address, o)
            for b, o in zip(backends, outcomes, strict=True)
            if not isinstance(o, bytes)
        ]
        if not answers:
            address, error = errors[0]
            codes = {call_status(e)[0] for _, e in errors if isinstance(e, grpc.aio.AioRpcError)}
            if len(codes) == 1 and isinstance(error, grpc.aio.AioRpcError):
                code, details = call_status(error)
                self._finish(method, code, started)
                await context.abort(code, details)
            self._finish(method, grpc.StatusCode.UNAVAILABLE, started)
            await abort_with_status(
                Unavailable(f"router: {method} failed on every backend ({address}: {error})"),
                context,
                method,
            )
        for address, error in errors:
            log.warning("%s could not reach backend %s: %s", method, address, error)
        self._finish(method, grpc.StatusCode.OK, started)
        return answers

    async def abort_everywhere(self, request: bytes, context: Context) -> bytes:
        """Abort reaches every backend: the router does not track which one runs a request
        (its id may be one the server assigned), and an unknown id is ignored there."""
        aborted: dict[str, None] = {}
        for raw in await self.everywhere(ABORT, request, context):
            aborted.update(
                dict.fromkeys(data_plane_pb2.AbortResponse.FromString(raw).aborted_request_ids)
            )
        return data_plane_pb2.AbortResponse(aborted_request_ids=list(aborted)).SerializeToString()

    async def finish_session_everywhere(self, request: bytes, context: Context) -> bytes:
        """FinishSession reaches every backend (a session may have lived on more than one:
        it moves when its server fails) and frees the session's place here too."""
        with suppress(Exception):  # malformed: the backends will say so
            parsed = data_plane_pb2.FinishSessionRequest.FromString(request)
            self.pool.placement.sessions.finish(parsed.session_id)
        answers = await self.everywhere(FINISH_SESSION, request, context)
        found = any(data_plane_pb2.FinishSessionResponse.FromString(raw).found for raw in answers)
        return data_plane_pb2.FinishSessionResponse(found=found).SerializeToString()

    async def unary_unary(self, method: str, request: bytes, context: Context) -> bytes:
        response = b""
        # Read to the end (not just the first message): the path's bookkeeping runs there.
        async for message in self.relay(method, request, context, partial(start_unary, method)):
            response = message
        return response

    # grpc drives async generator functions only; aclosing() closes the path as soon as the
    # handler is closed (a cancelled call), not when the collector gets to it.

    async def unary_stream(
        self, method: str, request: bytes, context: Context
    ) -> AsyncIterator[bytes]:
        migration = StreamMigration.for_call(method, request, self.options.max_migrations)
        start: Starter = (
            self._start_generation
            if method == GENERATE_STREAM
            else partial(start_server_stream, method)
        )
        async with aclosing(
            self.relay(method, request, context, start, migration=migration)
        ) as relayed:
            async for message in relayed:
                yield message

    async def generation(
        self, request: data_plane_pb2.GenerateStreamRequest, context: Context
    ) -> AsyncIterator[data_plane_pb2.GenerateStreamResponse]:
        """A GenerateStream for a caller in this process (the HTTP edge): the same path as a
        gRPC caller's, its request and chunks as messages (never serialized to be parsed
        again where the multiplexed call has them parsed)."""
        migration = StreamMigration.for_call(GENERATE_STREAM, request, self.options.max_migrations)
        start = partial(self._start_generation, parsed=True)
        relayed = self.relay(
            GENERATE_STREAM,
            request,
            context,
            start,
            migration=migration,
            parse=data_plane_pb2.GenerateStreamResponse.FromString,
        )
        async with aclosing(relayed):
            async for message in relayed:
                yield message

    async def stream_stream(
        self, method: str, requests: AsyncIterator[bytes], context: Context
    ) -> AsyncIterator[bytes]:
        """Methods the router does not know yet: relayed both ways, never retried (the
        requests cannot be sent twice)."""

        def start(
            backend: Backend, _: bytes, metadata: Metadata, timeout: float | None
        ) -> Upstream:
            multicallable: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = (
                backend.channel.stream_stream(method)
            )
            return multicallable(requests, timeout=timeout, metadata=metadata)

        async with aclosing(
            self.relay(method, b"", context, start, replayable=False, unread=requests)
        ) as relayed:
            async for message in relayed:
                yield message

    def begin(self, backend: Backend, method: str) -> None:
        """A call (or a request of a batch) starts on ``backend``."""
        self.pool.begin(backend)
        self.metrics.requests.labels(method, backend.address).inc()
        self.metrics.in_flight.labels(backend.address).set(backend.in_flight)

    def end(self, backend: Backend, failed: bool) -> None:
        """... and ends."""
        self.pool.end(backend, failed)
        self.metrics.in_flight.labels(backend.address).set(backend.in_flight)

    def _finish(self, method: str, code: grpc.StatusCode, started: float, worker: str = "") -> None:
        self.metrics.latency.labels(method).observe(time.perf_counter() - started)
        if code != grpc.StatusCode.OK:
            self.metrics.errors.labels(method, code.name, worker).inc()
