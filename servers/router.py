"""The routing proxy: one address in front of many engine servers.

Every DataPlane call is forwarded to one backend as raw bytes (the router never decodes a
payload, so contract additions need no router change): a generic handler relays request and
response messages, all metadata (``x-session-id``, auth, tracing), the deadline, and the final
status. The backend is chosen by ``BackendPool.choose`` (session hash ring, else least loaded),
and announced to the caller in the ``x-skyrl-backend`` response header. A call that fails
UNAVAILABLE before any response message reached the caller is retried on another backend
(bounded, with backoff); after the first message it never is.

The router also serves RouterAdmin (membership at runtime), grpc.health.v1 (SERVING iff a
backend is healthy), reflection, and Prometheus metrics over HTTP.

Run: ``skyrl-grpc-router --backends host:port,host:port`` or ``python -m servers.router``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from skyrl_grpc.metadata import ROUTED_TO, SESSION_ID
from skyrl_grpc.tls import TlsConfig
from skyrl_grpc.v1 import data_plane_pb2, router_pb2, router_pb2_grpc

from .backends import CHANNEL_OPTIONS, Backend, BackendPool, ChannelFactory, insecure_channel
from .early_answer import read_rest
from .interceptors import BearerTokenInterceptor, ErrorMappingInterceptor
from .lifecycle import (
    ServerTls,
    add_tls_arguments,
    announce,
    bind,
    configure_logging,
    grpc_server_options,
    tls_from_args,
)
from .migration import StreamMigration
from .router_admin import RouterAdminServicer
from .router_metrics import RouterMetrics

log = logging.getLogger(__name__)

DATA_PLANE_DESCRIPTOR = data_plane_pb2.DESCRIPTOR.services_by_name["DataPlane"]
DATA_PLANE = DATA_PLANE_DESCRIPTOR.full_name
ROUTER_ADMIN = router_pb2.DESCRIPTOR.services_by_name["RouterAdmin"].full_name
# Metadata the transport owns; everything else is forwarded as is.
# How long a call answered with an error keeps reading what the caller still sends.
READ_REST_SECONDS = 5.0
_NOT_FORWARDED = ("grpc-", ":")
_NOT_FORWARDED_KEYS = {"user-agent", "te", "content-type"}


def forwarded_metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, Any], ...]:  # type: ignore[type-arg]
    return tuple(
        (key, value)
        for key, value in (context.invocation_metadata() or ())
        if not key.startswith(_NOT_FORWARDED) and key not in _NOT_FORWARDED_KEYS
    )


def session_of(metadata: Sequence[tuple[str, Any]]) -> str | None:
    for key, value in metadata:
        if key == SESSION_ID:
            return str(value)
    return None


@dataclass
class ProxyOptions:
    max_retries: int = 2  # extra backends to try for a call that failed before any response
    retry_backoff_seconds: float = 0.05
    # How often one GenerateStream may move to another backend when its backend dies (0: off).
    max_migrations: int = 2


@dataclass
class Proxy:
    """Forwards calls to the backend ``pool.choose`` picks."""

    pool: BackendPool
    metrics: RouterMetrics
    options: ProxyOptions = field(default_factory=ProxyOptions)

    def _pick(self, session: str | None, tried: set[str]) -> Backend:
        backend = self.pool.choose(session, frozenset(tried))
        if backend is not None:
            return backend
        members = self.pool.backends
        if not members:
            detail = "the router has no backends: add one with RouterAdmin/AddBackend"
        elif tried:
            detail = f"every backend tried failed ({', '.join(sorted(tried))})"
        else:
            states = ", ".join(
                f"{b.address} {router_pb2.BackendState.Name(b.state)}"  # type: ignore[arg-type]
                for b in members
            )
            detail = f"no healthy backend ({states})"
        raise _NoBackend(detail)

    async def _retry_or_raise(
        self, error: grpc.aio.AioRpcError, backend: Backend, method: str, attempt: int
    ) -> None:
        if error.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.options.max_retries:
            raise error
        self.pool.mark_unavailable(backend)
        self.metrics.retries.labels(method).inc()
        await asyncio.sleep(self.options.retry_backoff_seconds * (2**attempt))

    async def unary_unary(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext
    ) -> bytes:  # type: ignore[type-arg]
        metadata = forwarded_metadata(context)
        session = session_of(metadata)
        tried: set[str] = set()
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            for attempt in range(self.options.max_retries + 1):
                backend = self._pick(session, tried)
                tried.add(backend.address)
                self._begin(backend, method)
                failed = True
                try:
                    call = backend.channel.unary_unary(method)(
                        request, timeout=context.time_remaining(), metadata=metadata
                    )
                    response: bytes = await call
                    failed = False
                    await context.send_initial_metadata(((ROUTED_TO, backend.address),))
                    return response
                except grpc.aio.AioRpcError as error:
                    code = error.code()
                    await self._retry_or_raise(error, backend, method, attempt)
                finally:
                    self._end(backend, failed)
            raise AssertionError("unreachable")
        except grpc.aio.AioRpcError as error:
            code = error.code()
            await context.abort(code, error.details() or "", tuple(error.trailing_metadata() or ()))
            raise
        except _NoBackend as error:
            code = grpc.StatusCode.UNAVAILABLE
            await context.abort(code, f"router: {error}")
            raise
        finally:
            self._finish(method, code, started)

    async def unary_stream(
        self,
        method: str,
        request: bytes,
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> AsyncIterator[bytes]:
        metadata = forwarded_metadata(context)
        session = session_of(metadata)
        migration = StreamMigration.for_call(method, request, self.options.max_migrations)
        payload = request
        tried: set[str] = set()
        retries = 0
        committed = False  # a message reached the caller: headers are sent
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        call = None
        try:
            while True:
                backend = self._pick(session, tried)
                tried.add(backend.address)
                self._begin(backend, method)
                failed = True
                try:
                    call = backend.channel.unary_stream(method)(
                        payload, timeout=context.time_remaining(), metadata=metadata
                    )
                    try:
                        message = await call.read()
                    except grpc.aio.AioRpcError as error:
                        # Nothing of this upstream reached the caller: safe to try elsewhere.
                        code = error.code()
                        await self._retry_or_raise(error, backend, method, retries)
                        retries += 1
                        continue
                    if not committed:
                        await context.send_initial_metadata(((ROUTED_TO, backend.address),))
                    try:
                        while message is not grpc.aio.EOF:
                            committed = True
                            yield message if migration is None else migration.observe(message)  # type: ignore[arg-type,misc]
                            message = await call.read()
                    except grpc.aio.AioRpcError as error:
                        if error.code() != grpc.StatusCode.UNAVAILABLE:
                            raise
                        self.pool.mark_unavailable(backend)
                        if migration is None or not migration.can_migrate():
                            why = "migration is off" if migration is None else "no migrations left"
                            raise _LostBackend(
                                f"backend {backend.address} was lost mid-stream "
                                f"({error.details()}); {why}"
                            ) from error
                        payload = migration.continuation(backend.address)
                        self.metrics.migrations.labels(method).inc()
                        log.warning("migrating a stream from lost backend %s", backend.address)
                        continue
                    failed = False
                    return
                finally:
                    self._end(backend, failed)
        except grpc.aio.AioRpcError as error:
            code = error.code()
            await context.abort(code, error.details() or "", tuple(error.trailing_metadata() or ()))
        except (_NoBackend, _LostBackend) as error:
            code = grpc.StatusCode.UNAVAILABLE
            await context.abort(code, f"router: {error}")
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            if call is not None and not call.done():
                call.cancel()  # the caller went away: stop the generation upstream
            self._finish(method, code, started)

    async def stream_stream(
        self,
        method: str,
        requests: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> AsyncIterator[bytes]:
        """Methods the router does not know yet: relayed both ways, never retried."""
        metadata = forwarded_metadata(context)
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        call = None
        backend = None
        failed = True
        try:
            backend = self._pick(session_of(metadata), set())
            self._begin(backend, method)
            call = backend.channel.stream_stream(method)(
                requests, timeout=context.time_remaining(), metadata=metadata
            )
            await context.send_initial_metadata(((ROUTED_TO, backend.address),))
            async for message in call:
                yield message
            failed = False
        except grpc.aio.AioRpcError as error:
            code = error.code()
            await read_rest(requests, READ_REST_SECONDS)
            await context.abort(code, error.details() or "", tuple(error.trailing_metadata() or ()))
        except _NoBackend as error:
            code = grpc.StatusCode.UNAVAILABLE
            await read_rest(requests, READ_REST_SECONDS)
            await context.abort(code, f"router: {error}")
        finally:
            if call is not None and not call.done():
                call.cancel()
            if backend is not None:
                self._end(backend, failed)
            self._finish(method, code, started)

    def _begin(self, backend: Backend, method: str) -> None:
        self.pool.begin(backend)
        self.metrics.requests.labels(method, backend.address).inc()
        self.metrics.in_flight.labels(backend.address).set(backend.in_flight)

    def _end(self, backend: Backend, failed: bool) -> None:
        self.pool.end(backend, failed)
        self.metrics.in_flight.labels(backend.address).set(backend.in_flight)

    def _finish(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.metrics.latency.labels(method).observe(time.perf_counter() - started)
        if code != grpc.StatusCode.OK:
            self.metrics.errors.labels(method, code.name).inc()


class _NoBackend(Exception):
    """No backend can take the call; the message says why."""


class _LostBackend(Exception):
    """The backend serving a stream died and the stream could not move."""


class ForwardingHandler(grpc.GenericRpcHandler):
    """Routes every method of the proxied services to the Proxy, as raw bytes."""

    def __init__(self, proxy: Proxy, services: Sequence[str] = (DATA_PLANE,)) -> None:
        self._proxy = proxy
        self._prefixes = tuple(f"/{s}/" for s in services)
        # Known methods keep their real shape (cheaper than a bidi stream); unknown methods of
        # a proxied service (a newer contract than this router) are relayed as bidi streams.
        self._streaming = {
            f"/{DATA_PLANE}/{m.name}": (m.client_streaming, m.server_streaming)
            for m in DATA_PLANE_DESCRIPTOR.methods
        }

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if not method.startswith(self._prefixes):
            return None
        shape = self._streaming.get(method, (True, True))
        # partial keeps the coroutine / async-generator nature grpc inspects to drive the call.
        if shape == (False, False):
            return grpc.unary_unary_rpc_method_handler(partial(self._proxy.unary_unary, method))
        if shape == (False, True):
            return grpc.unary_stream_rpc_method_handler(partial(self._proxy.unary_stream, method))
        return grpc.stream_stream_rpc_method_handler(partial(self._proxy.stream_stream, method))


def backend_channel_factory(tls: TlsConfig | None) -> ChannelFactory:
    """Plain channels to backends, or TLS ones (with a client certificate for mTLS backends)."""
    if tls is None:
        return insecure_channel
    options = list(CHANNEL_OPTIONS)
    if tls.server_name_override:
        options.append(("grpc.ssl_target_name_override", tls.server_name_override))

    def secure(address: str) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(address, tls.credentials(), options=options)

    return secure


@dataclass
class RouterOptions:
    backends: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    health_check_interval: float = 1.0
    balancing: str = "least-outstanding"
    proxy: ProxyOptions = field(default_factory=ProxyOptions)
    drain_grace_seconds: float = 10.0
    # Bearer token required on RouterAdmin (membership changes); None leaves it open.
    admin_token: str | None = None
    # TLS on the router's own port, and (backend_tls) on its connections to the servers.
    tls: ServerTls | None = None
    backend_tls: TlsConfig | None = None


class RouterServer:
    """Builds and runs the router; ``start()`` returns once the port is open."""

    def __init__(self, options: RouterOptions) -> None:
        self.options = options
        self.metrics = RouterMetrics()
        self.health = health.aio.HealthServicer()
        self.pool = BackendPool(
            options.backends,
            channel_factory=backend_channel_factory(options.backend_tls),
            check_interval=options.health_check_interval,
            balancing=options.balancing,
            on_change=self._backend_changed,
        )
        self.proxy = Proxy(self.pool, self.metrics, options.proxy)
        self.server = grpc.aio.server(
            # Only admin calls raise domain errors; forwarded calls skip the interceptor.
            interceptors=[
                BearerTokenInterceptor({ROUTER_ADMIN: options.admin_token or ""}),
                ErrorMappingInterceptor(services=[ROUTER_ADMIN]),
            ],
            options=grpc_server_options(64 << 20),
        )
        self.port = 0
        self.metrics_port: int | None = None
        self._serving: bool | None = None
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def _backend_changed(self, backend: Backend) -> None:
        self.metrics.healthy.labels(backend.address).set(1 if backend.eligible else 0)
        serving = bool(self.pool.healthy())
        if serving != self._serving:
            self._serving = serving
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for service in ("", DATA_PLANE):
                asyncio.get_running_loop().create_task(self.health.set(service, status))

    async def start(self) -> None:
        self.server.add_generic_rpc_handlers((ForwardingHandler(self.proxy),))
        router_pb2_grpc.add_RouterAdminServicer_to_server(
            RouterAdminServicer(self.pool), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for service in ("", DATA_PLANE):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(ROUTER_ADMIN, health_pb2.HealthCheckResponse.SERVING)
        reflection.enable_server_reflection(
            [DATA_PLANE, ROUTER_ADMIN, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = bind(self.server, f"{self.options.host}:{self.options.port}", self.options.tls)
        await self.server.start()
        await self.pool.start()
        if self.options.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.options.metrics_port, self.options.host)
        log.info("router listening on %s for %s", self.address, ", ".join(self.options.backends))

    async def wait_healthy(self, count: int = 1, timeout: float = 30) -> None:
        """Waits until ``count`` backends are healthy."""
        deadline = time.monotonic() + timeout
        while len(self.pool.healthy()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.pool.healthy())} of {count} backends healthy")
            await asyncio.sleep(0.05)

    async def stop(self, grace: float | None = None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.options.drain_grace_seconds if grace is None else grace)
        await self.pool.close()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skyrl-grpc-router", description="Route DataPlane calls to engine servers."
    )
    parser.add_argument(
        "--backends", default="", help="comma-separated host:port of engine servers"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50050, help="0 picks a free port")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    parser.add_argument("--health-check-interval", type=float, default=1.0)
    parser.add_argument(
        "--balancing", choices=["least-outstanding", "round-robin"], default="least-outstanding"
    )
    parser.add_argument("--max-retries", type=int, default=2)
    parser.add_argument(
        "--max-migrations", type=int, default=2, help="0 turns stream migration off"
    )
    add_tls_arguments(parser)
    parser.add_argument("--backend-tls-ca", default=None, help="PEM CA to verify TLS backends")
    parser.add_argument(
        "--backend-tls-cert", default=None, help="client certificate for mTLS backends"
    )
    parser.add_argument("--backend-tls-key", default=None, help="its private key")
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("SKYRL_ROUTER_ADMIN_TOKEN"),
        help="require this bearer token on RouterAdmin (default: $SKYRL_ROUTER_ADMIN_TOKEN)",
    )
    return parser


def options_from_args(args: argparse.Namespace) -> RouterOptions:
    return RouterOptions(
        backends=[b for b in args.backends.split(",") if b],
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        health_check_interval=args.health_check_interval,
        balancing=args.balancing,
        proxy=ProxyOptions(max_retries=args.max_retries, max_migrations=args.max_migrations),
        admin_token=args.admin_token,
        tls=tls_from_args(args),
        backend_tls=(
            TlsConfig(args.backend_tls_ca, args.backend_tls_cert, args.backend_tls_key)
            if args.backend_tls_ca or args.backend_tls_cert
            else None
        ),
    )


async def serve(options: RouterOptions) -> None:
    router = RouterServer(options)
    await router.start()
    announce("listening", address=router.address, metrics_port=router.metrics_port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(router.stop()))
    await router.wait_stopped()
    announce("stopped", address=router.address)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging()
    asyncio.run(serve(options_from_args(args)))


if __name__ == "__main__":
    main()
