"""Per-step streams under load: tokens per message and throughput of the engine server's own
``GenerateStream`` (one server, direct), and of the trainer client's ``stream`` (over one
``GenerateMultiplex`` call to that server, or to the router in front of it; through the router
also a ``GenerateStream`` call each), against vLLM's HTTP server's streamed completions
(tokens per server-sent event), at 64 and 256 concurrent streams of 128 tokens, rounds
interleaved (issue 70, item 3: a busy server sends fewer, fuller messages; one stream alone
still gets a message per engine step).

Both merge what a lagging reader has not taken yet: vLLM's output collector merges the deltas
waiting for a stream; this server's streams take every step that arrived since they last
wrote, merged (``skyrl_grpc.stream_chunks.merge_backlog``).

The server runs twice: on its default loop (uvloop, as vLLM's servers run) and on asyncio's
(``--event-loop asyncio``), side by side. Beside tokens/s: the CPU per 1000 tokens of the
server's own process (vLLM's API server process for vLLM; the engine core apart; through the
router, the server's and the router's) and of this process, the one Python client reading every
stream.

Run: .venv/bin/python -m scripts.bench_stream_messages [--rounds 3] [--output docs/performance.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import psutil

from scripts.bench_common import (
    ProcessTree,
    add_output_argument,
    cpu_seconds,
    median_range,
    write_report,
)
from scripts.rollout_clients import (
    MessageCount,
    RunBatch,
    client_streams,
    grpc_streams,
    http_streams,
)
from servers.fleet.local import LocalFleet
from testbed.peers import SERVED_NAME, vllm_http_server

TOKENS = 128


def serving_cpu(processes: list[psutil.Process]) -> float:
    return sum(cpu_seconds(process) for process in processes)


async def measure(
    run: RunBatch, counted: MessageCount, streams: int, batch: int, server: list[psutil.Process]
) -> dict[str, float]:
    """One round of ``streams`` concurrent streams: tokens/s, tokens per message, and the CPU
    ms per 1000 tokens of ``server`` (the serving processes) and of this process (the client)."""
    before = counted.messages
    started, server_cpu = time.perf_counter(), serving_cpu(server)
    client_cpu = time.process_time()
    tokens = await run(streams, TOKENS, batch)
    seconds = time.perf_counter() - started
    messages = counted.messages - before
    return {
        "tok_s": tokens / seconds,
        # Not counted for the multiplexed client (one message a step carries every stream).
        "per_message": tokens / messages if messages else float("nan"),
        "server_cpu": 1e6 * (serving_cpu(server) - server_cpu) / tokens,
        "client_cpu": 1e6 * (time.process_time() - client_cpu) / tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", default="1,64,256")
    add_output_argument(parser, "performance.md")
    args = parser.parse_args()
    sizes = [int(s) for s in args.streams.split(",")]
    ours, on_asyncio, vllm = "server GenerateStream", "server, --event-loop asyncio", "vllm-http"
    client = "trainer client stream (multiplexed)"
    routed = "trainer client stream through the router (multiplexed)"
    routed_calls = "trainer client stream through the router (a call each)"
    names = [ours, client, routed, routed_calls, on_asyncio, vllm]
    multiplexed = (client, routed)
    results: dict[tuple[str, int], list[dict[str, float]]] = {
        (n, s): [] for n in names for s in sizes
    }
    with (
        LocalFleet(1) as fleet,
        LocalFleet(1, engine_args=["--event-loop", "asyncio"]) as asyncio_fleet,
        vllm_http_server() as http,
    ):
        # Each contender frozen whole while another runs (a fleet's idle router too); its
        # serving process measured.
        trees = {
            ours: ProcessTree(*fleet.pids),
            client: ProcessTree(*fleet.pids),
            routed: ProcessTree(*fleet.pids),
            routed_calls: ProcessTree(*fleet.pids),
            on_asyncio: ProcessTree(*asyncio_fleet.pids),
            vllm: ProcessTree(http.process.pid),
        }
        roots = {
            ours: fleet.pids[:1],
            client: fleet.pids[:1],
            routed: fleet.pids,  # the server, then the router
            routed_calls: fleet.pids,
            on_asyncio: asyncio_fleet.pids[:1],
            vllm: [http.process.pid],
        }
        for tree in trees.values():
            tree.freeze()

        async def rounds() -> None:
            # The clients' channels and sessions belong to this loop: made here.
            counted = {name: MessageCount() for name in names}
            runs = {
                name: grpc_streams(server.addresses.servers[0], 0, False, counted[name])
                for name, server in ((ours, fleet), (on_asyncio, asyncio_fleet))
            }
            runs[vllm] = http_streams(http.address, SERVED_NAME, counted[vllm])
            # InferenceClient.stream per prompt, straight to the server over one
            # GenerateMultiplex call (its router's view picks the server).
            runs[client] = client_streams(fleet.addresses.router, [fleet.addresses.servers[0]])
            # The same, every stream through the router over one GenerateMultiplex call to it.
            runs[routed] = client_streams(
                fleet.addresses.router, [fleet.addresses.servers[0]], direct=False
            )
            runs[routed_calls] = client_streams(
                fleet.addresses.router,
                [fleet.addresses.servers[0]],
                multiplex=False,
                counted=counted[routed_calls],
                direct=False,
            )
            for name, run in runs.items():  # first generations are slow
                trees[name].thaw()
                await run(16, TOKENS, 0)
                trees[name].freeze()
            for round_index in range(args.rounds):
                shift = round_index % len(names)
                for name in names[shift:] + names[:shift]:
                    trees[name].thaw()
                    for streams in sizes:
                        figures = await measure(
                            runs[name], counted[name], streams, round_index + 1,
                            [psutil.Process(pid) for pid in roots[name]],
                        )  # fmt: skip
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
        "HTTP server, same engine settings; the six taking turns; medians, ranges in "
        "brackets; CPU: ms per 1000 tokens of the serving processes (through the router, the "
        "server's and the router's), the engine core apart, and of the one client process; "
        "2 cores).",
        "",
        "| streams | contender | tokens/s | tokens per message (event) | server CPU | client CPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    columns = (("tok_s", 0), ("per_message", 2), ("server_cpu", 0), ("client_cpu", 0))
    for streams in sizes:
        for name in names:
            runs = results[(name, streams)]
            cells = [median_range([r[key] for r in runs], digits) for key, digits in columns]
            if name in multiplexed:  # its streams' chunks arrive in one message a step for all
                cells[1] = "one message a step for every stream"
            lines.append(f"| {streams} | {name} | {' | '.join(cells)} |")
    lines += ["", "Against vLLM's HTTP server (median of per-round ratios):", ""]
    for streams in sizes:
        theirs = results[(vllm, streams)]
        for name in (ours, client, routed, routed_calls, on_asyncio):

            def ratio(
                key: str, mine: Any = results[(name, streams)], theirs: Any = theirs
            ) -> float:
                pairs = zip(mine, theirs, strict=True)
                return float(statistics.median(a[key] / b[key] for a, b in pairs))

            per_message = (
                ""
                if name in multiplexed
                else f"tokens per message {ratio('per_message'):.2f} (target >= 1.0), "
            )
            lines.append(
                f"- {streams} streams, {name}: tokens/s {ratio('tok_s'):.2f} (target >= 1.0), "
                f"{per_message}server CPU per token {ratio('server_cpu'):.2f}, client CPU per "
                f"token {ratio('client_cpu'):.2f}"
            )
    write_report(args.output, lines, "stream-messages")


if __name__ == "__main__":
    main()
