"""``skyrl-grpc``: one command line for the stack. Every command has ``--help``.

- ``serve``: one engine server (the same as ``python -m servers.engine``: one entry point,
  ``servers.engine.process.engine_server.run``, whichever command starts it).
- ``route``: the router (the same as ``python -m servers.router``).
- ``up``: N engine servers and a router, as local processes or on Ray; runs until Ctrl-C.
- ``demo``: the end-to-end RL loop on the embedded tiny model: starts a fleet, then runs the
  trainer (``trainer_client.demo``) as a process of its own against it, as a real trainer
  would be (the server package never imports the client package).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from servers import fleet_commands
from servers.common.process import configure_logging, exit_on_sigterm
from servers.engine import options as engine_options
from servers.fleet import Fleet, FleetStartFailed, gateway
from servers.fleet.local import LocalFleet, served_model_directory
from servers.router import router_server as router


def _serve(args: argparse.Namespace, _: list[str]) -> None:
    from servers.engine.process import engine_server as server

    server.run(engine_options.options_from_args(args))


def _route(args: argparse.Namespace, _: list[str]) -> None:
    asyncio.run(router.serve(router.options_from_args(args)))


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags = [] if args.kv_cache_gib is None else ["--kv-cache-gib", str(args.kv_cache_gib)]
    if args.model:
        flags += ["--model", args.model]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.enable_lora:
        flags += ["--enable-lora"]
    return flags


def _server_ports(args: argparse.Namespace) -> list[int]:
    """One port per server, the standbys' after the serving ones'."""
    count = args.servers + args.standby
    if args.server_ports:
        ports = [int(p) for p in args.server_ports.split(",")]
        if len(ports) != count:
            standbys = f" + --standby {args.standby}" if args.standby else ""
            raise SystemExit(
                f"--server-ports lists {len(ports)} ports for --servers {args.servers}{standbys}"
            )
        return ports
    if args.base_port == 0:
        return [0] * count
    return [args.base_port + i for i in range(count)]


def make_fleet(args: argparse.Namespace, server_args: list[str] | None = None) -> Fleet:
    """The fleet the stack flags describe (not started); ``server_args``: more `serve` flags
    for every server (``up`` passes through whatever it does not know itself)."""
    traced = (
        ["--otlp-traces-endpoint", args.otlp_traces_endpoint] if args.otlp_traces_endpoint else []
    )
    server_flags = [*_engine_flags(args), *traced, *(server_args or [])]
    # The router's edge tokenizes text prompts with the served model's own tokenizer files
    # (checked against the servers' first; a router on a node without them asks the servers).
    tokenizer = served_model_directory(server_flags)
    if args.ray:
        from servers.fleet.ray_group import RayFleet

        return RayFleet(
            args.servers,
            # Unset: as the installed engine runs (a CPU engine never waits for a GPU).
            cpu_only=True if args.cpu_only else None,
            server_args=server_flags,
            strategy=args.placement_strategy,
            resources=json.loads(args.ray_resources) if args.ray_resources else {},
            host=args.host,
            ray_address=args.ray_address,
            start_timeout=args.start_timeout,
            server_ports=_server_ports(args),
            router_port=args.router_port,
            http_port=args.http_port,
            metrics_port=args.metrics_port,
            log_dir=args.log_dir,
            router_replicas=args.router_replicas,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            tokenizer=tokenizer,
            standby=args.standby,
        )
    router_args = ["--replicas", str(args.router_replicas)] if args.router_replicas > 1 else []
    if args.metrics_port is not None:
        router_args += ["--metrics-port", str(args.metrics_port)]
    if args.http_port is not None:
        router_args += ["--http-port", str(args.http_port)]
    if args.otlp_traces_endpoint:
        router_args += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    return LocalFleet(
        args.servers,
        engine_args=server_flags,
        router_args=router_args,
        # Each server's vLLM metrics and its own on a port of its own (printed, with a
        # Prometheus scrape configuration, by ``up``).
        server_metrics=True,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        host=args.host,
        server_ports=_server_ports(args),
        router_port=args.router_port,
        start_timeout=args.start_timeout,
        standby=args.standby,
    )


def _add_stack_arguments(
    parser: argparse.ArgumentParser, servers: int, router_port: int = 0, base_port: int = 0
) -> None:
    parser.add_argument("--servers", type=int, default=servers, help="number of engine servers")
    parser.add_argument(
        "--standby",
        type=int,
        default=0,
        help="warm standbys beside them: kept current (every weight update and adapter reaches "
        "them) but given no traffic; one takes a dead server's place at once",
    )
    parser.add_argument(
        "--model", default=None, help="model directory (default: embedded tiny model)"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="CPU: KV cache per engine (default: 1 GiB; 0.125 for the embedded tiny model)",
    )
    parser.add_argument(
        "--enable-lora", action="store_true", help="engine servers serve LoRA adapters"
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=Fleet.start_timeout,
        help="seconds each server may take to become ready, at start and when restarted or "
        "added (a large model, or a busy machine, may need more)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="OpenTelemetry traces of the servers and the router over OTLP/gRPC to this "
        "host:port (default: none)",
    )
    parser.add_argument("--ray", action="store_true", help="place the servers on Ray (RayFleet)")
    parser.add_argument(
        "--ray-address", default=None, help="Ray cluster to join (default: start one)"
    )
    parser.add_argument(
        "--cpu-only",
        action="store_true",
        help="Ray placement without GPUs (the default where vLLM's CPU build is installed)",
    )
    parser.add_argument(
        "--placement-strategy",
        default="PACK",
        choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
        help="Ray: how servers' bundles spread over nodes (STRICT_SPREAD: one per node)",
    )
    parser.add_argument(
        "--ray-resources",
        default=None,
        help="Ray: custom resources each server needs, as JSON (e.g. '{\"inference\": 1}' "
        "for nodes started with --resources '{\"inference\": N}')",
    )
    ports = parser.add_argument_group("addresses and logs (local processes and Ray alike)")
    ports.add_argument(
        "--host",
        default="127.0.0.1",
        help="address every process binds (Ray across nodes, or an edge reachable from outside "
        "the cluster: 0.0.0.0, advertised as the node IP)",
    )
    ports.add_argument("--router-port", type=int, default=router_port, help="0: any free port")
    parser.add_argument(
        "--router-replicas",
        type=int,
        default=1,
        help="router processes sharing the router's gRPC and HTTP ports (the kernel spreads "
        "connections among them), each restarted if it dies; they agree on every session's "
        "server",
    )
    ports.add_argument(
        "--base-port",
        type=int,
        default=base_port,
        help="servers listen on this port and the next ones (0: any free ports)",
    )
    ports.add_argument("--server-ports", default=None, help="comma-separated, one per server")
    ports.add_argument("--metrics-port", type=int, default=None, help="router's /metrics port")
    ports.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="router's OpenAI-compatible HTTP port (/v1/...; 0: any free port)",
    )
    ports.add_argument(
        "--log-dir",
        default=None,
        help="one log file per process here (default: none kept; on Ray, on each actor's node)",
    )


class Stopped(Exception):
    """A signal asked ``up`` to stop before its fleet had started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _up(args: argparse.Namespace, server_args: list[str]) -> None:
    started = threading.Event()
    stopping = threading.Event()

    def stop(signum: int, _: object) -> None:
        if stopping.is_set():
            return  # already on the way out: let the fleet close
        stopping.set()
        if not started.is_set():
            raise Stopped(signum)  # unwinds the start: the fleet closes what it started

    # Set before anything starts, not left to Python's KeyboardInterrupt (a process started in
    # the background by a script, ``skyrl-grpc up &``, inherits SIGINT ignored) nor to Ray's
    # SIGTERM handling (a native stack dump, nothing closed): a signal at any point stops the
    # fleet and prints one line.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with make_fleet(args, server_args) as fleet:
        started.set()
        print(f"router: {fleet.addresses.router}")
        fleet_commands.print_servers(fleet.addresses)
        host = fleet.addresses.router.rpartition(":")[0]
        if fleet.metrics_port is not None:
            print(f"router metrics: http://{host}:{fleet.metrics_port}/metrics")
        if isinstance(fleet, LocalFleet):
            _print_scrape_config(fleet, host)
        if fleet.http_port is not None:
            print(f"OpenAI API: http://{host}:{fleet.http_port}/v1")
        if args.log_dir:
            where = " (on each actor's node)" if args.ray else ""
            print(f"logs: {Path(args.log_dir).resolve()}{where}")
        fleet.supervise()  # a server that dies is reported and started again
        log_dir = Path(args.log_dir) if args.log_dir else None
        try:
            smg = (
                gateway.launch_for(
                    fleet, host, args.gateway_port, log_dir, shlex.split(args.gateway_args)
                )
                if args.gateway
                else None
            )
        except RuntimeError as error:  # one line, as a fleet that fails to start
            raise FleetStartFailed(f"--gateway {args.gateway}: {error}") from None
        try:
            if smg is not None:
                print(f"SMG (OpenAI API): {smg.base}/v1")
                print(f"SMG metrics: http://{host}:{smg.metrics_port}/metrics")
            admin = fleet_commands.serve_fleet_admin(fleet, host, args.admin_port, args.admin_token)
            threading.Thread(
                target=fleet_commands.read_commands, args=(fleet,), daemon=True
            ).start()
            print("Ctrl-C to stop; type `scale N` to grow or shrink the fleet", flush=True)
            while not stopping.wait(0.5):
                pass
            print("stopping ...", flush=True)
            if admin is not None:
                admin.stop(grace=None)
        finally:
            if smg is not None:
                smg.close()
    print("stopped", flush=True)


def _print_scrape_config(fleet: LocalFleet, host: str) -> None:
    """Each server's /metrics, and a Prometheus scrape configuration for the fleet."""
    servers = [
        f"{host}:{port}"
        for port in wait_for_metrics_ports(fleet.server_metrics_ports)
        if port is not None
    ]
    for index, target in enumerate(servers):
        print(f"server {index} metrics: http://{target}/metrics")
    router = [f"{host}:{fleet.metrics_port}"] if fleet.metrics_port else []
    print("prometheus scrape_configs:")
    for job, targets in (("skyrl-servers", servers), ("skyrl-router", router)):
        if targets:
            print(f"  - job_name: {job}\n    static_configs:\n      - targets: {targets}")


def wait_for_metrics_ports(ports: list[int | None], seconds: float = 10.0) -> list[int | None]:
    """The servers' metrics ports once each has said it (they listen before they serve)."""
    deadline = time.monotonic() + seconds
    while any(port == 0 for port in ports) and time.monotonic() < deadline:
        time.sleep(0.05)
    return list(ports)


def _demo(args: argparse.Namespace, trainer_args: list[str]) -> None:
    if args.model:
        print("the demo trains the embedded tiny model; --model is not used", file=sys.stderr)
        args.model = None
    if "--lora" in trainer_args:
        args.enable_lora = True  # the trainer pushes an adapter: the servers must take it
    # Ctrl-C and SIGTERM unwind (the fleet's ``with`` closes it), also when this was started with
    # SIGINT ignored (a script's background job), where Python would never raise
    # KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    started = time.perf_counter()
    print(f"starting {args.servers} engine servers and a router on the tiny model ...", flush=True)
    with make_fleet(args) as fleet:
        addresses = fleet.addresses
        print(
            f"stack up in {time.perf_counter() - started:.0f}s: "
            f"router {addresses.router}, servers {', '.join(addresses.servers)}",
            flush=True,
        )
        trainer = subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer_client.demo",
                "--router",
                addresses.router,
                "--servers",
                ",".join(addresses.servers),
                *trainer_args,
            ],
            check=False,
        )
    if trainer.returncode:
        raise SystemExit(trainer.returncode)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skyrl-grpc", description="The skyrl-grpc inference stack."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve",
        parents=[engine_options.build_parser()],
        add_help=False,
        help="serve one vLLM engine over gRPC",
    )
    serve.set_defaults(func=_serve)

    route = commands.add_parser(
        "route",
        parents=[router.build_parser()],
        add_help=False,
        help="route DataPlane calls to engine servers",
    )
    route.set_defaults(func=_route)

    up = commands.add_parser(
        "up",
        help="start N engine servers and a router (locally or on Ray) and keep them running",
        description="Starts N engine servers and a router and supervises them: a server that "
        "dies is reported and restarted on its address (with backoff); the router re-admits "
        "it. A restarted or added server reads its peers' weights and LoRA adapters before it "
        "serves. "
        "Every `skyrl-grpc serve` flag not listed here (--tool-call-parser, --data-token, "
        "--max-n, --dtype, TLS, ...) goes to every server, locally and on Ray.",
    )
    _add_stack_arguments(up, servers=2, router_port=50050, base_port=50051)
    fleet_commands.add_admin_arguments(up)
    gateway.add_gateway_arguments(up)
    up.set_defaults(func=_up)
    fleet_commands.add_scale_command(commands)

    demo = commands.add_parser(
        "demo",
        help="run the end-to-end RL demo on the embedded tiny model",
        epilog="Every other option goes to the trainer process (--steps, --batch-size, "
        "--max-tokens, --learning-rate, --seed, --transport, --no-sync, --lora, --output): see "
        "`python -m trainer_client.demo --help`.",
    )
    _add_stack_arguments(demo, servers=2)
    demo.set_defaults(func=_demo)
    return parser


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The command line, checked as ``main`` runs it but without running it (every flag; the
    server flags ``up`` passes on); exits naming what is wrong. Returns the arguments and what
    goes on to the demo's trainer (``demo``) or to every server (``up``)."""
    args, rest = build_parser().parse_known_args(argv)
    if rest and args.command == "up":
        # Every other `serve` flag goes to every server: checked here, before anything starts.
        serve = engine_options.build_parser()
        serve.prog = "skyrl-grpc up (server flags)"
        serve.parse_args(rest)
        if any(a.split("=")[0] in ("--host", "--port") for a in rest):
            raise SystemExit("skyrl-grpc up: servers' ports are --base-port / --server-ports")
    if args.command == "up":
        gateway.refuse_unreachable(args.gateway, rest, args.gateway_args)
    elif rest and args.command != "demo":
        build_parser().parse_args(argv)  # reports the unknown arguments and exits
    return args, rest


def main(argv: list[str] | None = None) -> None:
    args, rest = parse(argv)
    configure_logging(logging.WARNING if args.command in ("demo", "up") else logging.INFO)
    try:
        args.func(args, rest)
    except FleetStartFailed as error:  # one line, not a traceback: the logs (--log-dir) say more
        raise SystemExit(f"skyrl-grpc {args.command}: {error}") from None
    except Stopped as stopped:
        print(f"skyrl-grpc {args.command}: stopped by {stopped} while starting", file=sys.stderr)
        raise SystemExit(128 + stopped.signum) from None


if __name__ == "__main__":
    main()
