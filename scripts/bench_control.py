"""Control-plane latency on an idle server and under the heaviest data-plane load, one run.

A trainer must be able to pause a busy fleet promptly: that is exactly when it needs to. This
starts one engine server (tiny model) and measures, directly against it, the round trip of
GetLoad, IsPaused and Pause(KEEP) + Resume, first idle, then while 64 streams with n=4, logprobs
and prompt logprobs 20 (the most a request may ask for) keep it saturated; idle and loaded rounds
alternate. Target: p99 <= 100 ms under load.

Run: .venv/bin/python -m scripts.bench_control [--rounds 2] [--samples 60] [--output docs/training.md]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

from scripts.bench_common import add_output_argument, percentile, write_report
from servers.fleet.local import LocalFleet
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc, data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen

HEAVY = gen.SamplingParams(temperature=1.0, max_tokens=200, logprobs=20, prompt_logprobs=20)


async def load(address: str, streams: int, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """``streams`` concurrent heavy GenerateStream calls, each restarted when it ends."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)

        async def one(index: int) -> None:
            prompt = [1, *(100 + (index * 7 + k) % 1800 for k in range(60))]
            while not stop.is_set():
                call = stub.GenerateStream(
                    data_plane_pb2.GenerateStreamRequest(
                        prompt_token_ids=prompt, sampling_params=HEAVY, n=4
                    )
                )
                async for chunk in call:
                    counts["tokens"] += len(chunk.token_ids)
                    if stop.is_set():
                        call.cancel()
                        break

        await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)


async def probe(
    name: str, call: Callable[[], Awaitable[object]], samples: int, spacing: float
) -> list[float]:
    latencies = []
    for _ in range(samples):
        started = time.perf_counter()
        await call()
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(spacing)
    return latencies


async def measure(address: str, samples: int) -> dict[str, list[float]]:
    async with grpc.aio.insecure_channel(address) as channel:
        control = control_plane_pb2_grpc.ControlPlaneStub(channel)

        pauses: list[float] = []
        resumes: list[float] = []

        async def pause_resume() -> None:
            started = time.perf_counter()
            await control.Pause(cp.PauseRequest(mode=cp.PAUSE_MODE_KEEP))
            paused = time.perf_counter()
            await control.Resume(cp.ResumeRequest())
            pauses.append(paused - started)
            resumes.append(time.perf_counter() - paused)

        measured = {
            "GetLoad": await probe(
                "GetLoad", lambda: control.GetLoad(cp.GetLoadRequest()), samples, 0.02
            ),
            "IsPaused": await probe(
                "IsPaused", lambda: control.IsPaused(cp.IsPausedRequest()), samples, 0.02
            ),
        }
        await probe("Pause+Resume", pause_resume, max(samples // 2, 5), 0.1)
        measured["Pause(KEEP)"] = pauses
        measured["Resume"] = resumes
        return measured


async def run(rounds: int, samples: int, streams: int) -> list[str]:
    results: dict[tuple[str, str], list[float]] = {}
    throughput: list[float] = []
    with LocalFleet(1) as fleet:
        address = fleet.addresses.servers[0]
        for _ in range(rounds):
            for condition in ("idle", "loaded"):
                stop = asyncio.Event()
                counts = {"tokens": 0}
                background = None
                if condition == "loaded":
                    background = asyncio.create_task(load(address, streams, stop, counts))
                    await asyncio.sleep(3)  # let the load saturate the server
                started = time.perf_counter()
                measured = await measure(address, samples)
                elapsed = time.perf_counter() - started
                if background is not None:
                    stop.set()
                    await background
                    throughput.append(counts["tokens"] / (elapsed + 3))
                for name, latencies in measured.items():
                    results.setdefault((condition, name), []).extend(latencies)
    lines = [
        "### Control-plane latency: idle vs saturated (`python -m scripts.bench_control`)",
        "",
        f"One engine server (tiny model, 2-core machine), measured directly. Load: {streams} "
        "GenerateStream calls with n=4, logprobs=20, prompt_logprobs=20, 200 tokens, each "
        f"restarted when it ends ({min(throughput, default=0):.0f}-"
        f"{max(throughput, default=0):.0f} output tokens/s while measured). {rounds} rounds, "
        "idle and loaded alternating. Target: p99 <= 100 ms under load.",
        "",
        "| call | condition | calls | p50 (ms) | p99 (ms) | max (ms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (condition, name), latencies in sorted(results.items(), key=lambda kv: kv[0][1]):
        lines.append(
            f"| {name} | {condition} | {len(latencies)} | {percentile(latencies, 0.5) * 1e3:.1f} "
            f"| {percentile(latencies, 0.99) * 1e3:.1f} | {max(latencies) * 1e3:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--streams", type=int, default=64)
    add_output_argument(parser, "training.md")
    args = parser.parse_args()
    lines = asyncio.run(run(args.rounds, args.samples, args.streams))
    write_report(args.output, lines, "bench_control")


if __name__ == "__main__":
    main()
