"""``skyrl-grpc``: one command line for the stack.

Commands: ``serve`` (one engine server), ``demo`` (the end-to-end loop on the embedded model).
Each has ``--help``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from . import engine_server


def _demo(args: argparse.Namespace) -> None:
    from .demo import run_demo

    run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skyrl-grpc", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve",
        help="serve one vLLM engine over gRPC",
        parents=[engine_server.build_parser()],
        add_help=False,
    )
    serve.set_defaults(
        func=lambda a: asyncio.run(engine_server.serve(engine_server.options_from_args(a)))
    )

    demo = commands.add_parser("demo", help="run the end-to-end demo on the embedded tiny model")
    from .demo import add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.command == "demo" else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    args.func(args)


if __name__ == "__main__":
    main()
