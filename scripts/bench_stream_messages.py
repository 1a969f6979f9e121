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
from typing import Any

from scripts.bench_common import (
    ProcessTree,
    add_output_argument,
    median_range,
    write_report,
)
from scripts.rollout_clients import MessageCount, RunBatch, grpc_streams, http_streams
from servers.fleet.local import LocalFleet
from testbed.peers import SERVED_NAME, vllm_http_server

TOKENS = 128


async def measure(
    run: RunBatch, counted: MessageCount, streams: int, batch: int
) -> dict[str, float]:
    """One round of ``streams`` concurrent streams: tokens/s and tokens per message."""
    before = counted.messages
    started = time.perf_counter()
    tokens = await run(streams, TOKENS, batch)
    seconds = time.perf_counter() - started
    return {"tok_s": tokens / seconds, "per_message": tokens / (counted.messages - before)}


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
        trees = {names[0]: ProcessTree(*fleet.pids), names[1]: ProcessTree(http.process.pid)}
        for tree in trees.values():
            tree.freeze()

        async def rounds() -> None:
            # The clients' channels and sessions belong to this loop: made here.
            counted = {name: MessageCount() for name in names}
            runs = {
                names[0]: grpc_streams(
                    fleet.addresses.servers[0], 0, sessions=False, counted=counted[names[0]]
                ),
                names[1]: http_streams(http.address, SERVED_NAME, counted[names[1]]),
            }
            for name, run in runs.items():  # first generations are slow
                trees[name].thaw()
                await run(16, TOKENS, 0)
                trees[name].freeze()
            for round_index in range(args.rounds):
                order = names if round_index % 2 == 0 else names[::-1]
                for name in order:
                    trees[name].thaw()
                    for streams in sizes:
                        figures = await measure(runs[name], counted[name], streams, round_index + 1)
                        results[(name, streams)].append(figures)
                        print(f"round {round_index + 1} {name} {streams}: {figures}", flush=True)
                    trees[name].freeze()

        try:
            asyncio.run(rounds())
        finally:  # before the servers stop: a frozen process never sees its parent go
            for tree in trees.values():
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
            return float(
                statistics.median(a[key] / b[key] for a, b in zip(ours, theirs, strict=True))
            )

        lines.append(
            f"- {streams} streams: tokens/s {ratio('tok_s'):.2f} (target >= 1.0), tokens per "
            f"message {ratio('per_message'):.2f} (target >= 1.0)"
        )
    write_report(args.output, lines, "stream-messages")


if __name__ == "__main__":
    main()
