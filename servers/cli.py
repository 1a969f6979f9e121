"""``skyrl-grpc``: one command line for the stack. Every command has ``--help``.

- ``serve``: one engine server (the same as ``skyrl-grpc-server``).
- ``route``: the router (the same as ``skyrl-grpc-router``).
- ``up``: N engine servers and a router, as local processes or on Ray; runs until Ctrl-C.
- ``demo``: the end-to-end RL loop on the embedded tiny model (starts its own stack).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

from . import engine_server, router
from .lifecycle import configure_logging


def _serve(args: argparse.Namespace) -> None:
    asyncio.run(engine_server.serve(engine_server.options_from_args(args)))


def _route(args: argparse.Namespace) -> None:
    asyncio.run(router.serve(router.options_from_args(args)))


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--kv-cache-gib", str(args.kv_cache_gib)]
    if args.model:
        flags += ["--model", args.model]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    return flags


class _Stack:
    """A started stack of either kind, with the same three members."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._impl: object = None
        self.router_address = ""
        self.server_addresses: list[str] = []

    def __enter__(self) -> _Stack:
        if self._args.ray:
            import ray

            from .server_group import ServerGroup

            if not ray.is_initialized():
                ray.init(address=self._args.ray_address, include_dashboard=False)
            engine = {
                "model": self._args.model,
                "max_model_len": self._args.max_model_len,
                "kv_cache_gib": self._args.kv_cache_gib,
            }
            group = ServerGroup(self._args.servers, cpu_only=self._args.cpu_only, engine=engine)
            self.router_address, self.server_addresses = group.start()
            self._impl = group
        else:
            from .launcher import LocalStack

            stack = LocalStack(self._args.servers, engine_args=_engine_flags(self._args)).start()
            self.router_address, self.server_addresses = (
                stack.router_address,
                stack.server_addresses,
            )
            self._impl = stack
        return self

    def __exit__(self, *exc: object) -> None:
        if self._args.ray:
            self._impl.shutdown()  # type: ignore[attr-defined]
        else:
            self._impl.close()  # type: ignore[attr-defined]


def _add_stack_arguments(parser: argparse.ArgumentParser, servers: int) -> None:
    parser.add_argument("--servers", type=int, default=servers, help="number of engine servers")
    parser.add_argument(
        "--model", default=None, help="model directory (default: embedded tiny model)"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="CPU: KV cache per engine")
    parser.add_argument("--ray", action="store_true", help="place the servers on Ray (ServerGroup)")
    parser.add_argument(
        "--ray-address", default=None, help="Ray cluster to join (default: start one)"
    )
    parser.add_argument("--cpu-only", action="store_true", help="Ray placement without GPUs")


def _up(args: argparse.Namespace) -> None:
    with _Stack(args) as stack:
        print(f"router: {stack.router_address}")
        for address in stack.server_addresses:
            print(f"server: {address}")
        print("Ctrl-C to stop", flush=True)
        stopping = False

        def stop(*_: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        try:
            while not stopping:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass


def _demo(args: argparse.Namespace) -> None:
    from skyrl_grpc.tiny_model import ensure_tiny_model
    from trainer_client import InferenceClient
    from trainer_client.demo import DemoConfig, plot_rewards, run_rl_loop

    if args.model:
        print("the demo trains the embedded tiny model; --model is not used", file=sys.stderr)
        args.model = None
    model_dir = ensure_tiny_model()
    config = DemoConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        learning_rate=args.learning_rate,
        seed=args.seed,
        sync=not args.no_sync,
        transport=args.transport,
    )
    started = time.perf_counter()
    print(f"starting {args.servers} engine servers and a router on the tiny model ...", flush=True)
    with _Stack(args) as stack:
        servers = ", ".join(stack.server_addresses)
        print(
            f"stack up in {time.perf_counter() - started:.0f}s: "
            f"router {stack.router_address}, servers {servers}",
            flush=True,
        )
        client = InferenceClient(stack.router_address, stack.server_addresses)
        result = asyncio.run(run_rl_loop(client, model_dir, config))
    first, last = result.summary()
    title = "reward per step" + ("" if config.sync else " (weight sync off)")
    path = plot_rewards(result, Path(args.output), title)
    syncs = [s for s in result.sync_seconds if s]
    mean_sync = sum(syncs) / len(syncs) if syncs else 0.0
    print(
        f"reward: first steps {first:.3f} -> last steps {last:.3f}; "
        f"{result.abort_retries} rollouts resubmitted after aborts; mean sync {mean_sync:.2f}s"
    )
    print(f"reward curve written to {path.resolve()}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skyrl-grpc", description="The skyrl-grpc inference stack."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve",
        parents=[engine_server.build_parser()],
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

    up = commands.add_parser("up", help="start N engine servers and a router (locally or on Ray)")
    _add_stack_arguments(up, servers=2)
    up.set_defaults(func=_up)

    demo = commands.add_parser("demo", help="run the end-to-end RL demo on the embedded tiny model")
    _add_stack_arguments(demo, servers=2)
    demo.add_argument("--steps", type=int, default=20)
    demo.add_argument("--batch-size", type=int, default=16)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--learning-rate", type=float, default=1e-2)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--transport", choices=["grpc", "collective"], default="grpc")
    demo.add_argument("--no-sync", action="store_true", help="control run: never push weights")
    demo.add_argument(
        "--output", default="artifacts/demo-reward.png", help="where to write the reward curve"
    )
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(logging.WARNING if args.command in ("demo", "up") else logging.INFO)
    args.func(args)


if __name__ == "__main__":
    main()
