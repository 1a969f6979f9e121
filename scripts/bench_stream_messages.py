"""Per-step streams under load: tokens per message and throughput of the engine server's own
``GenerateStream`` (one server, direct) against vLLM's HTTP server's streamed completions
(tokens per server-sent event), at 64 and 256 concurrent streams of 128 tokens, rounds
interleaved (issue 70, item 3: a busy server sends fewer, fuller messages; one stream alone
still gets a message per engine step).

Both merge what a lagging reader has not taken yet: vLLM's output collector merges the deltas
waiting for a stream; this server's streams take every step that arrived since they last
wrote, merged (``skyrl_grpc.stream_chunks.merge_backlog``).

Run: .venv/bin/python -m scripts.bench_stream_messages [--rounds 3] [--output docs/performance.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from scripts.bench_common import (
    SERVED_NAME,
    ProcessTree,
    add_output_argument,
    median_range,
    vllm_http_server,
    write_report,
)
from scripts.rollout_clients import greedy, prompt_for
from servers.fleet.local import LocalFleet
from skyrl_grpc.v1 import data_plane_pb2_grpc

TOKENS = 128
# (tokens, messages) of one round of ``streams`` concurrent streams.
Counted = Callable[[int, int], Awaitable[tuple[int, int]]]


def grpc_streams(address: str) -> Counted:
    stubs: list[Any] = []  # made on the loop that runs the rounds

    async def run(streams: int, batch: int) -> tuple[int, int]:
        if not stubs:
            stubs.append(data_plane_pb2_grpc.DataPlaneStub(grpc.aio.insecure_channel(address)))
        stub = stubs[0]

        async def one(sample: int) -> tuple[int, int]:
            request = greedy(TOKENS)
            request.prompt_token_ids.extend(prompt_for(sample, batch))
            tokens = messages = 0
            async for chunk in stub.GenerateStream(request):
                tokens += len(chunk.token_ids)
                messages += 1
            return tokens, messages

        counts = await asyncio.gather(*(one(s) for s in range(streams)))
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    return run


# The HTTP client's sessions, closed once the rounds end (on their loop).
SESSIONS: list[Any] = []


def http_streams(base_url: str) -> Counted:
    import aiohttp
    import orjson

    sessions = SESSIONS

    async def run(streams: int, batch: int) -> tuple[int, int]:
        if not sessions:
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=None)
            sessions.append(aiohttp.ClientSession(connector=connector, timeout=timeout))

        async def one(sample: int) -> tuple[int, int]:
            body = {
                "model": SERVED_NAME, "prompt": prompt_for(sample, batch), "max_tokens": TOKENS,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            }  # fmt: skip
            tokens = events = 0
            async with sessions[0].post(f"{base_url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        event = orjson.loads(line[6:])
                        tokens += len(event["choices"][0].get("token_ids") or ())
                        events += 1
            return tokens, events

        counts = await asyncio.gather(*(one(s) for s in range(streams)))
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    return run


async def measure(run: Counted, streams: int, batch: int) -> dict[str, float]:
    started = time.perf_counter()
    tokens, messages = await run(streams, batch)
    seconds = time.perf_counter() - started
    return {"tok_s": tokens / seconds, "per_message": tokens / messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", default="1,64,256")
    add_output_argument(parser, "performance.md")
    args = parser.parse_args()
    sizes = [int(s) for s in args.streams.split(",")]
    names = ["server GenerateStream", "vllm-http"]
    results: dict[tuple[str, int], list[dict[str, float]]] = {
        (n, s): [] for n in names for s in sizes
    }
    with LocalFleet(1) as fleet, vllm_http_server() as http:
        contenders = {
            names[0]: (grpc_streams(fleet.addresses.servers[0]), ProcessTree(*fleet.pids)),
            names[1]: (http_streams(http.address), ProcessTree(http.process.pid)),
        }
        for _, tree in contenders.values():
            tree.freeze()

        async def rounds() -> None:
            for run, tree in contenders.values():  # first generations are slow
                tree.thaw()
                await run(16, 0)
                tree.freeze()
            for round_index in range(args.rounds):
                order = names if round_index % 2 == 0 else names[::-1]
                for name in order:
                    run, tree = contenders[name]
                    tree.thaw()
                    for streams in sizes:
                        figures = await measure(run, streams, round_index + 1)
                        results[(name, streams)].append(figures)
                        print(f"round {round_index + 1} {name} {streams}: {figures}", flush=True)
                    tree.freeze()
            for _, tree in contenders.values():
                tree.thaw()
            for session in SESSIONS:
                await session.close()

        try:
            asyncio.run(rounds())
        finally:  # before the servers stop: a frozen process never sees its parent go
            for _, tree in contenders.values():
                tree.thaw()

    lines = [
        f"`python -m scripts.bench_stream_messages --rounds {args.rounds}` (streams of "
        f"{TOKENS} tokens, greedy, 16-token prompts; one engine server direct against vLLM's "
        "HTTP server, same engine settings; medians, ranges in brackets; 2 cores).",
        "",
        "| streams | contender | tokens/s | tokens per message (event) |",
        "| --- | --- | --- | --- |",
    ]
    for streams in sizes:
        for name in names:
            runs = results[(name, streams)]
            lines.append(
                f"| {streams} | {name} | {median_range([r['tok_s'] for r in runs], 0)} | "
                f"{median_range([r['per_message'] for r in runs], 2)} |"
            )
    lines += ["", "Server / vLLM's HTTP server (median of per-round ratios):", ""]
    for streams in sizes:
        ours, theirs = results[(names[0], streams)], results[(names[1], streams)]

        def ratio(key: str, ours: Any = ours, theirs: Any = theirs) -> float:
            return statistics.median(a[key] / b[key] for a, b in zip(ours, theirs, strict=True))

        lines.append(
            f"- {streams} streams: tokens/s {ratio('tok_s'):.2f} (target >= 1.0), tokens per "
            f"message {ratio('per_message'):.2f} (target >= 1.0)"
        )
    write_report(args.output, lines, "stream-messages")


if __name__ == "__main__":
    main()
