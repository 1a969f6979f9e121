"""The event loops a server process runs on (``--event-loop``): uvloop or asyncio's own.

uvloop is the engine server's default, as it is in vLLM's own HTTP and gRPC servers: each
message of a per-step stream costs grpc's asyncio layer a completion, a wake-up of the loop and
a task step, and uvloop's loop does those in C. Measured with 64 streams of 128 tokens against
vLLM's HTTP server (``scripts/bench_stream_messages.py``): 0.80x its tokens/s on asyncio's loop,
1.00x on uvloop, the server's own CPU per token 80 ms against 64 per 1000 tokens.
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
