"""The routing proxy: one address in front of many engine servers.

``RouterServer`` serves DataPlane (every call forwarded to one backend by ``proxy``; the choice
is ``BackendPool.choose`` in ``backends``), RouterAdmin (membership at runtime, ``admin``),
grpc.health.v1 (SERVING iff a backend is healthy), reflection, and Prometheus metrics over HTTP
(``metrics``).

Run: ``skyrl-grpc route --backends host:port,host:port`` or ``python -m servers.router``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from servers.common.interceptors import BearerTokenInterceptor, ErrorMappingInterceptor
from servers.common.listener import (
    ServerTls,
    add_message_size_argument,
    add_tls_arguments,
    bind,
    server_options,
    tls_from_args,
)
from servers.common.process import configure_logging, serve_until_stopped
from servers.common.reaper import exit_with_supervisor
from servers.common.tasks import BackgroundTasks
from servers.router.admin import RouterAdminServicer
from servers.router.backends import Backend, BackendPool
from servers.router.forwarding import ForwardingHandler
from servers.router.http_edge.asgi import HttpEdgeServer
from servers.router.http_edge.handlers import OpenAIEdge
from servers.router.http_edge.local_tokenizer import LocalTokenizer
from servers.router.metrics import RouterMetrics
from servers.router.proxy import Proxy, ProxyOptions
from servers.router.siblings import Siblings
from skyrl_grpc import tracing
from skyrl_grpc.channels import DEFAULT_MAX_MESSAGE_BYTES, MiB, liveness_options, open_channel
from skyrl_grpc.names import DATA_PLANE, ROUTER_ADMIN, WATCH_BACKENDS
from skyrl_grpc.placement import POLICIES
from skyrl_grpc.tls import TlsConfig
from skyrl_grpc.v1 import router_pb2_grpc

log = logging.getLogger(__name__)
DEFAULT_PORT = 50050  # the command line's; RouterOptions(port=0) picks a free port


@dataclass
class RouterOptions:
    backends: list[str] = field(default_factory=list)
    # Of ``backends``, the warm standbys (members given no data-plane calls; RouterAdmin
    # SetStandby changes a member's role).
    standbys: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    health_check_interval: float = 1.0
    # A backend that answers no keepalive ping within this many seconds is lost: its
    # connection is closed, so the streams on it migrate (a host cut off by the network, whose
    # connections would otherwise hang until TCP gives up). Pings every half of it.
    backend_liveness_seconds: float = 2.0
    balancing: str = "least-outstanding"
    # Where sessions go: "bounded-load" (least-loaded, sticky, never past (1 + epsilon) x the
    # mean), "sticky-least-loaded" (the same, unbounded) or "consistent-hash" (a hash ring).
    placement: str = "bounded-load"
    proxy: ProxyOptions = field(default_factory=ProxyOptions)
    drain_grace_seconds: float = 10.0
    # Bearer token required on RouterAdmin (membership changes); None leaves it open.
    admin_token: str | None = None
    # TLS on the router's own port, and (backend_tls) on its connections to the servers.
    tls: ServerTls | None = None
    backend_tls: TlsConfig | None = None
    # Largest message accepted from callers and relayed to backends: set it as the servers'.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # The OpenAI-compatible HTTP edge's port (0: any free port); None: no HTTP edge.
    http_port: int | None = None
    # Tokens per upstream message for streamed HTTP answers (1: an event per engine step).
    http_stream_interval: int = 1
    # One of several replicas sharing the gRPC and HTTP ports (``replicas``): its number, in its
    # metrics and logs; None: the only router on its ports. ``replica_ports``: each replica's
    # own port (on ``host``), where its siblings pass membership changes on (``siblings``).
    replica: int | None = None
    replica_ports: list[int] = field(default_factory=list)
    # The served model's directory: the HTTP edge tokenizes text prompts with its tokenizer
    # files (checked against the servers' first) instead of a Tokenize call each. None: calls.
    tokenizer: str | None = None
    # OpenTelemetry traces over OTLP/gRPC (vLLM's flag): a span per forwarded call and per
    # HTTP request, its context passed on to the server. None: off, at no cost.
    otlp_traces_endpoint: str | None = None


class RouterServer:
    """Builds and runs the router; ``start()`` returns once the port is open."""

    def __init__(self, options: RouterOptions) -> None:
        self.options = options
        self.metrics = RouterMetrics(options.replica)
        self.health = health.aio.HealthServicer()
        self.pool = BackendPool(
            options.backends,
            standbys=options.standbys,
            channel_factory=partial(
                open_channel,
                tls=options.backend_tls,
                max_message_bytes=options.max_message_bytes,
                extra_options=liveness_options(options.backend_liveness_seconds),
            ),
            check_interval=options.health_check_interval,
            balancing=options.balancing,
            placement=options.placement,
            on_change=self._backend_changed,
        )
        self.proxy = Proxy(self.pool, self.metrics, options.proxy)
        self.server = grpc.aio.server(
            # Only admin calls raise domain errors; forwarded calls skip the interceptor.
            interceptors=[
                BearerTokenInterceptor(
                    {ROUTER_ADMIN: options.admin_token or ""}, open_methods=[WATCH_BACKENDS]
                ),
                ErrorMappingInterceptor(services=[ROUTER_ADMIN]),
            ],
            options=server_options(
                options.max_message_bytes, reuse_port=options.replica is not None
            ),
        )
        self.port = 0
        self.metrics_port: int | None = None
        self.http: HttpEdgeServer | None = None
        self._serving: bool | None = None
        self._tasks = BackgroundTasks()
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def _backend_changed(self, backend: Backend) -> None:
        address = backend.address
        if any(member is backend for member in self.pool.backends):
            self.proxy.events.health(address, backend.healthy, backend.state_name)
            self.proxy.events.role(address, backend.standby)
        else:
            self.proxy.events.removed(address)
        if not backend.eligible:
            # Draining, lost, removed or a standby: its multiplexed calls take nothing new and
            # end with their requests, so a draining server finishes them and is not held open.
            self.proxy.multiplexers.retire(address)
        self.metrics.healthy.labels(address).set(1 if backend.healthy else 0)
        self.metrics.standby.labels(address).set(1 if backend.standby else 0)
        self.metrics.paused.labels(address).set(1 if backend.paused else 0)
        self.metrics.prompt_tokens.labels(address).set(backend.status.prompt_tokens)
        self.metrics.cached_prompt_tokens.labels(address).set(backend.status.cached_prompt_tokens)
        self.metrics.weight_version.labels(address).set(backend.weight_version)
        sessions = self.pool.placement.sessions.live_sessions()
        for member in self.pool.backends:  # zero too: a gauge keeps its last value otherwise
            self.metrics.live_sessions.labels(member.address).set(sessions[member.address])
        serving = bool(self.pool.serving())
        if serving != self._serving:
            self._serving = serving
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for service in ("", DATA_PLANE):
                self._tasks.spawn(self.health.set(service, status))

    async def start(self) -> None:
        self.server.add_generic_rpc_handlers((ForwardingHandler(self.proxy),))
        siblings = None
        options = self.options
        if options.replica is not None and options.replica_ports:
            # Where its siblings call it: replicas share a host, so its loopback (the admin
            # token, if any, still applies).
            own = options.replica_ports[options.replica]
            bind(self.server, f"127.0.0.1:{own}", None)
            siblings = Siblings(
                options.replica,
                [f"127.0.0.1:{port}" for port in options.replica_ports],
                options.admin_token,
            )
        router_pb2_grpc.add_RouterAdminServicer_to_server(
            RouterAdminServicer(self.pool, siblings), self.server
        )
        if siblings is not None:  # a promotion here is a membership change there too
            told = siblings
            self.pool.on_promoted = lambda up, lost: self._tasks.spawn(told.promotion(up, lost))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for service in ("", DATA_PLANE):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(ROUTER_ADMIN, health_pb2.HealthCheckResponse.SERVING)
        reflection.enable_server_reflection(
            [DATA_PLANE, ROUTER_ADMIN, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = bind(self.server, f"{self.options.host}:{self.options.port}", self.options.tls)
        await self.server.start()
        # A replica that starts while its siblings run routes to the fleet they route to now.
        current = await siblings.membership() if siblings is not None else None
        await self.pool.start(current)
        if self.options.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.options.metrics_port, self.options.host)
        if self.options.http_port is not None:
            edge = OpenAIEdge(
                self.proxy,
                self.pool,
                self.options.http_stream_interval,
                self.options.replica,
                LocalTokenizer.load(self.options.tokenizer),
            )
            self.http = HttpEdgeServer(
                edge,
                self.options.host,
                self.options.http_port,
                reuse_port=self.options.replica is not None,
            )
            await self.http.start()
            log.info("OpenAI HTTP edge on http://%s:%d/v1", self.options.host, self.http.port)
        replica = "" if self.options.replica is None else f" (replica {self.options.replica})"
        log.info(
            "router%s listening on %s for %s",
            replica,
            self.address,
            ", ".join(self.options.backends),
        )

    async def wait_ready(self) -> None:
        """The router is ready once it listens: until a backend is healthy its health says
        NOT_SERVING and calls answer UNAVAILABLE."""

    async def wait_healthy(self, count: int = 1, timeout: float = 30) -> None:
        """Waits until ``count`` backends are healthy."""
        deadline = time.monotonic() + timeout
        while len(self.pool.healthy()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.pool.healthy())} of {count} backends healthy")
            await asyncio.sleep(0.05)

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def stop(self, grace: float | None = None) -> None:
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(self.options.drain_grace_seconds if grace is None else grace)
        await self.proxy.multiplexers.close()
        await self.pool.close()
        await self._tasks.close()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def build_parser() -> argparse.ArgumentParser:
    # Every default comes from the options' dataclasses: one place decides each of them.
    defaults, proxy = RouterOptions(), ProxyOptions()
    parser = argparse.ArgumentParser(
        prog="skyrl-grpc route", description="Route DataPlane calls to engine servers."
    )
    parser.add_argument(
        "--backends", default="", help="comma-separated host:port of engine servers"
    )
    parser.add_argument(
        "--standbys",
        default="",
        help="comma-separated host:port of warm standbys (also members: control calls and "
        "weight updates reach them, data-plane calls do not until RouterAdmin SetStandby)",
    )
    parser.add_argument("--host", default=defaults.host)
    # The command line's well-known port; in code, RouterOptions' 0 picks a free one.
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument(
        "--metrics-port", type=int, default=defaults.metrics_port, help="Prometheus /metrics port"
    )
    parser.add_argument(
        "--health-check-interval", type=float, default=defaults.health_check_interval
    )
    parser.add_argument(
        "--backend-liveness-seconds",
        type=float,
        default=defaults.backend_liveness_seconds,
        help="a server that answers no keepalive ping for this long is lost and its streams "
        "migrate (a host cut off by the network); pings every half of it (default %(default)s)",
    )
    parser.add_argument(
        "--tokenizer",
        default=defaults.tokenizer,
        help="the served model's directory: the HTTP edge tokenizes text prompts with its "
        "tokenizer.json (checked against the servers' on first use) instead of asking a server; "
        "without it (or on a host without the model's files) with the tokenizer a server hands "
        "over (GetTokenizer)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=defaults.otlp_traces_endpoint,
        help="send OpenTelemetry traces over OTLP/gRPC here (host:port): a span per call and "
        "HTTP request, its context passed on to the engine servers; default: none",
    )
    parser.add_argument(
        "--balancing",
        choices=["least-outstanding", "round-robin"],
        default=defaults.balancing,
        help="where calls without a session go",
    )
    parser.add_argument(
        "--placement",
        choices=list(POLICIES),
        default=defaults.placement,
        help="where sessions go: bounded-load (least-loaded, sticky, bounded at 1.25x the "
        "mean), sticky-least-loaded (least-loaded, sticky, unbounded) or consistent-hash "
        "(a hash ring)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=defaults.http_port,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "...) on this port (0 picks a free one); default: no HTTP",
    )
    parser.add_argument(
        "--http-stream-interval",
        type=int,
        default=defaults.http_stream_interval,
        help="tokens per upstream message for streamed HTTP answers (1: an event per step)",
    )
    parser.add_argument("--max-retries", type=int, default=proxy.max_retries)
    add_message_size_argument(parser)
    parser.add_argument(
        "--max-migrations",
        type=int,
        default=proxy.max_migrations,
        help="0 turns stream migration off",
    )
    parser.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the event loop the router runs on (gRPC and the HTTP edge share it)",
    )
    parser.add_argument(
        "--no-multiplex",
        action="store_true",
        help="forward each GenerateStream as its own call to its server (default: over one "
        "GenerateMultiplex call per server, a message per engine step for all of them)",
    )
    parser.add_argument(
        "--fail-when-paused",
        action="store_true",
        help="when every healthy backend is paused, answer UNAVAILABLE at once (default: "
        "calls wait for Resume, up to their deadline)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="run this many router processes on the same gRPC and HTTP ports (the kernel "
        "spreads connections among them), each supervised and restarted; they agree on "
        "every session's server (docs/fleet.md)",
    )
    parser.add_argument("--replica-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--replica-ports", default="", help=argparse.SUPPRESS)
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
        standbys=[b for b in args.standbys.split(",") if b],
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        health_check_interval=args.health_check_interval,
        backend_liveness_seconds=args.backend_liveness_seconds,
        balancing=args.balancing,
        placement=args.placement,
        proxy=ProxyOptions(
            max_retries=args.max_retries,
            max_migrations=args.max_migrations,
            fail_when_paused=args.fail_when_paused,
            multiplex=not args.no_multiplex,
        ),
        admin_token=args.admin_token,
        http_port=args.http_port,
        http_stream_interval=args.http_stream_interval,
        replica=args.replica_id,
        replica_ports=[int(p) for p in args.replica_ports.split(",") if p],
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        tokenizer=args.tokenizer,
        max_message_bytes=args.max_message_mib * MiB,
        tls=tls_from_args(args),
        backend_tls=(
            TlsConfig(args.backend_tls_ca, args.backend_tls_cert, args.backend_tls_key)
            if args.backend_tls_ca or args.backend_tls_cert
            else None
        ),
    )


async def serve(options: RouterOptions) -> None:
    tracing.configure("skyrl-router", options.otlp_traces_endpoint)
    router = RouterServer(options)
    await serve_until_stopped(
        router,
        router.stop,
        lambda: {"metrics_port": router.metrics_port, "http_port": router.http_port},
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging()
    exit_with_supervisor()
    if args.replicas > 1:
        from servers.router.replicas import serve_replicas

        asyncio.run(serve_replicas(args, sys.argv[1:] if argv is None else argv))
        return
    if args.event_loop == "uvloop":
        import uvloop

        uvloop.run(serve(options_from_args(args)))
    else:
        asyncio.run(serve(options_from_args(args)))


if __name__ == "__main__":
    main()
