"""The event loops a server process runs on (``--event-loop``): uvloop or asyncio's own.

uvloop is the engine server's default, as it is in vLLM's own HTTP and gRPC servers (and in Ray's
actors): each message of a per-step stream costs grpc's asyncio layer a wake-up of the loop and a
task step, which uvloop's loop does in C. Measured with 64 and 256 streams of 128 tokens beside
vLLM's HTTP server (``scripts/bench_stream_messages.py``, both start orders): the server's CPU
per token 0.87-0.97x asyncio's. The router keeps asyncio's by default: on uvloop its CPU per
token moved within the runs' spread (``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import asyncio

UVLOOP = "uvloop"
ASYNCIO = "asyncio"
EVENT_LOOPS = (UVLOOP, ASYNCIO)


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """A new loop of ``kind`` (one of ``EVENT_LOOPS``)."""
    if kind == UVLOOP:
        import uvloop

        return uvloop.new_event_loop()
    if kind == ASYNCIO:
        return asyncio.new_event_loop()
    raise ValueError(f"--event-loop {kind!r}: one of {', '.join(EVENT_LOOPS)}")


def add_event_loop_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str, runs: str
) -> None:
    """``--event-loop``, the loop ``runs`` (what the process runs on it) runs on."""
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=default,
        help=f"the event loop {runs} runs on (default %(default)s)",
    )
