"""Router benchmarks, side by side in one run (issue: routing proxy).

1. Router cost: streaming generation against one real vLLM engine server (tiny model), through
   the router vs directly, at 1, 16 and 64 concurrent streams, alternating the two paths:
   output tokens/s, p50/p99 time to first token, p50 inter-token latency (load code shared
   with scripts/bench_stack.py).
2. Balancing: a workload of uneven request lengths (every other request is 20x longer) over two
   stand-in backends whose step time grows with their batch, least-outstanding vs round robin:
   makespan and p50/p99 latency. (Stand-ins: the subject is the router's choice, not vLLM.)

Run: .venv/bin/python scripts/bench_router.py [--requests-per-stream 4] [--output docs/bench-router.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_stack import GrpcContender, Workload, compare, percentile, write_report  # noqa: E402

from servers.fleet.local import LocalFleet  # noqa: E402
from servers.router.router_server import RouterOptions, RouterServer  # noqa: E402
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc  # noqa: E402
from skyrl_grpc.v1 import generation_pb2 as gen  # noqa: E402
from tests.helpers.fake_backend import FakeBackend  # noqa: E402


async def router_cost(per_stream: int, max_tokens: int, rounds: int) -> list[str]:
    rows = [
        "| streams | path | output tok/s | p50 TTFT (ms) | p99 TTFT (ms) | p50 ITL (ms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    ratios = []
    with LocalFleet(1) as stack:
        contenders = [
            GrpcContender("direct", stack.addresses.servers[0]),
            GrpcContender("router", stack.addresses.router),
        ]
        for contender in contenders:  # first generations are slow
            await contender.run(Workload(8, 2, 16, 1))
        for concurrency in (1, 16, 64):
            workload = Workload(concurrency, per_stream, max_tokens, stream_interval=1)
            summary = await compare(contenders, workload, rounds)
            for path, s in summary.items():
                rows.append(
                    f"| {concurrency} | {path} | {s['tokens_per_s']:.0f} | {s['ttft_p50'] * 1e3:.1f} "
                    f"| {s['ttft_p99'] * 1e3:.1f} | {s['itl_p50'] * 1e3:.2f} |"
                )
            ratio = summary["router"]["tokens_per_s"] / summary["direct"]["tokens_per_s"]
            added = (summary["router"]["ttft_p50"] - summary["direct"]["ttft_p50"]) * 1000
            ratios.append(
                f"- {concurrency} streams: router / direct throughput = **{ratio:.2f}x**; "
                f"p50 time to first token added by the router: {added:+.1f} ms"
            )
    return rows + [""] + ratios


async def balancing(policy: str, requests: int, concurrency: int) -> dict[str, float]:
    backends = [
        await FakeBackend(f"b{i}", delay=0.001, per_stream_delay=0.0005).start() for i in range(2)
    ]
    router = RouterServer(
        RouterOptions(
            backends=[b.address for b in backends], balancing=policy, health_check_interval=0.5
        )
    )
    await router.start()
    await router.wait_healthy(2)
    channel = grpc.aio.insecure_channel(router.address)
    stub = data_plane_pb2_grpc.DataPlaneStub(channel)
    latencies: list[float] = []
    queue = list(range(requests))

    async def worker() -> None:
        while queue:
            index = queue.pop(0)
            length = 200 if index % 2 == 0 else 10
            started = time.perf_counter()
            async for _ in stub.GenerateStream(
                data_plane_pb2.GenerateStreamRequest(
                    prompt_token_ids=[1], sampling_params=gen.SamplingParams(max_tokens=length)
                )
            ):
                pass
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    makespan = time.perf_counter() - started
    await channel.close()
    await router.stop(0)
    for b in backends:
        await b.stop()
    return {
        "makespan": makespan,
        "p50": statistics.median(latencies),
        "p99": percentile(latencies, 0.99),
    }


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=str(ROOT / "docs" / "bench-router.md"))
    args = parser.parse_args()

    lines = [
        "# Router benchmarks",
        "",
        f"Command: `.venv/bin/python scripts/bench_router.py` (one run; "
        f"{args.requests_per_stream} requests per stream, {args.max_tokens} tokens each, a message per engine step, median of "
        f"{args.rounds} alternating rounds). Machine: 2 cores; client, router and server share them. "
        "docs/bench-stack.md has the same comparison at 256 streams and with coalesced messages.",
        "",
        "## Router cost (real vLLM engine server, tiny model)",
        "",
    ]
    lines += await router_cost(args.requests_per_stream, args.max_tokens, args.rounds)
    lines += [
        "",
        "## Load-aware balancing vs round robin (uneven lengths, 2 stand-in backends)",
        "",
        "| policy | makespan (s) | p50 latency (s) | p99 latency (s) |",
        "| --- | --- | --- | --- |",
    ]
    results = {}
    for policy in ("round-robin", "least-outstanding", "round-robin", "least-outstanding"):
        r = await balancing(policy, requests=128, concurrency=16)
        results.setdefault(policy, []).append(r)
    for policy, runs in results.items():
        m = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        results[policy] = [m]
        lines.append(f"| {policy} | {m['makespan']:.2f} | {m['p50']:.3f} | {m['p99']:.3f} |")
    speedup = results["round-robin"][0]["makespan"] / results["least-outstanding"][0]["makespan"]
    lines += [
        "",
        f"Least-outstanding finishes the workload **{speedup:.2f}x** faster than round robin "
        "(round robin over 2 backends sends every long request to the same one).",
    ]
    write_report(args.output, lines)


if __name__ == "__main__":
    asyncio.run(main())
