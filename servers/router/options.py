"""What a router is asked to be: ``RouterOptions``, and the command line that fills them
(``skyrl-grpc route`` / ``python -m servers.router``: ``build_parser``, ``options_from_args``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from servers.common.event_loops import ASYNCIO, add_event_loop_argument
from servers.common.listener import (
    ServerTls,
    add_message_size_argument,
    add_tls_arguments,
    tls_from_args,
)
from servers.router.proxy import ProxyOptions
from skyrl_grpc.channels import DEFAULT_MAX_MESSAGE_BYTES, MiB
from skyrl_grpc.placement import POLICIES
from skyrl_grpc.tls import TlsConfig

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
    # The servers capture routed experts (--enable-return-routed-experts): the HTTP edge asks
    # for them on every whole answer and returns them as vLLM's server does.
    routed_experts: bool = False


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
        "--routed-experts",
        action="store_true",
        help="the servers capture routed experts (serve --enable-return-routed-experts): the "
        "HTTP edge returns every whole answer's, as vLLM's server does (base64 .npy)",
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
    add_event_loop_argument(parser, ASYNCIO, "the router (its gRPC and the HTTP edge share it)")
    parser.add_argument(
        "--no-multiplex",
        action="store_true",
        help="forward each GenerateStream as its own call to its server (default: over one "
        "GenerateMultiplex call per server, a message per engine step for all of them)",
    )
    parser.add_argument(
        "--hold-seconds",
        type=float,
        default=proxy.hold_seconds,
        help="how long a call that finds no backend serving (every one lost at once: a "
        "partition, this router's own link) waits for one to serve again, within its "
        "deadline; a stream whose backend was lost waits so too, then moves there (0: "
        "UNAVAILABLE at once)",
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
            hold_seconds=args.hold_seconds,
            multiplex=not args.no_multiplex,
        ),
        admin_token=args.admin_token,
        http_port=args.http_port,
        http_stream_interval=args.http_stream_interval,
        routed_experts=args.routed_experts,
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
