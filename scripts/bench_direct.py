"""The trainer client's direct path vs the router hop, side by side in one run (issue:
proxyless routing).

Streaming generation at 16, 64 and 256 concurrent streams, a message per engine step and
16-token messages, contenders interleaved round by round (medians):

- ``in-process``     vLLM's AsyncLLM called in-process (the ceiling)
- ``direct``         GenerateStream straight to the one engine server
- ``router``         GenerateStream through the router
- ``client-direct``  InferenceClient.stream with direct routing: the router's view followed
                     over WatchBackends, calls sent straight to the server it picks

Target: client-direct >= 0.97x direct at 64 streams, and never below the router path.

Run: .venv/bin/python scripts/bench_direct.py [--rounds 3] [--output docs/bench-direct.md]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_stack import (  # noqa: E402
    GrpcContender,
    InProcessContender,
    Timing,
    Workload,
    compare,
    prompt_for,
    run_closed_loop,
    write_report,
)

from servers.fleet.local import LocalFleet  # noqa: E402
from trainer_client import InferenceClient  # noqa: E402


class ClientDirectContender:
    """InferenceClient.stream with direct routing (the default), given the router's address."""

    name = "client-direct"

    def __init__(self, router: str, servers: tuple[str, ...]) -> None:
        self.router = router
        self.servers = servers

    async def run(self, workload: Workload) -> dict[str, float]:
        async with InferenceClient(self.router, self.servers) as client:
            sampling = {"temperature": 0.0, "max_tokens": workload.max_tokens, "ignore_eos": True}

            async def one(index: int, turn: int) -> Timing:
                started = time.perf_counter()
                first = 0.0
                tokens = 0
                async for chunk in client.stream(
                    prompt_for(index, turn),
                    sampling,
                    session_id=f"session-{index}",
                    stream_interval=workload.stream_interval,
                ):
                    if chunk.token_ids and not tokens:
                        first = time.perf_counter() - started
                    tokens += len(chunk.token_ids)
                return Timing(first, time.perf_counter() - started, tokens)

            return await run_closed_loop(one, workload)


async def run(args: argparse.Namespace) -> list[str]:
    rows = [
        "| streams | messages | path | output tok/s | p50 TTFT (ms) | p50 ITL (ms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    ratios = []
    in_process = InProcessContender()
    try:
        with LocalFleet(1) as fleet:
            server = fleet.addresses.servers[0]
            contenders = [
                in_process,
                GrpcContender("direct", server),
                GrpcContender("router", fleet.addresses.router),
                ClientDirectContender(fleet.addresses.router, fleet.addresses.servers),
            ]
            for contender in contenders:  # first generations are slow
                await contender.run(Workload(8, 2, 16, 1))
            for interval in (1, 16):
                for concurrency in args.streams:
                    per_stream = max(1, args.requests // concurrency)
                    workload = Workload(concurrency, per_stream, args.max_tokens, interval)
                    summary = await compare(contenders, workload, args.rounds)  # type: ignore[arg-type]
                    label = "per step" if interval == 1 else f"{interval} tokens"
                    for path, s in summary.items():
                        rows.append(
                            f"| {concurrency} | {label} | {path} | {s['tokens_per_s']:.0f} "
                            f"| {s['ttft_p50'] * 1e3:.1f} | {s['itl_p50'] * 1e3:.2f} |"
                        )
                    own, direct = summary["client-direct"], summary["direct"]
                    ratios.append(
                        f"- {concurrency} streams, {label}: client-direct / direct "
                        f"{own['tokens_per_s'] / direct['tokens_per_s']:.2f}x, router / direct "
                        f"{summary['router']['tokens_per_s'] / direct['tokens_per_s']:.2f}x, "
                        f"client-direct / in-process "
                        f"{own['tokens_per_s'] / summary['in-process']['tokens_per_s']:.2f}x"
                    )
                    print(ratios[-1], flush=True)
    finally:
        in_process.close()
    return [
        "# Direct routing vs the router hop (scripts/bench_direct.py)",
        "",
        f"GenerateStream, {args.max_tokens} tokens per request, greedy; median of {args.rounds} "
        "interleaved rounds; one engine server (tiny model), 2 shared cores.",
        "",
        *rows,
        "",
        *ratios,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256, help="requests per point")
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    lines = asyncio.run(run(args))
    if args.output:
        write_report(args.output, lines)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
