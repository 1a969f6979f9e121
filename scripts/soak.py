"""Soak: minutes of mixed traffic with pause/resume and weight pushes every few seconds.

Starts 2 engine servers and a router (local processes, tiny model), then runs concurrent
rollouts (sessions and no sessions, uneven lengths, streaming and unary), while a controller
pauses (ABORT or KEEP), pushes weights (alternating two weight sets, both transports) and
resumes every few seconds. At the end it checks and prints: no leaked requests (every engine
reports 0 running / waiting), server RSS growth after warm-up within the bound, zero unexpected
errors. Exit code 1 if any check fails.

Run: .venv/bin/python -m scripts.soak --seconds 180 [--rss-growth-mib 300]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from scripts.bench_common import tree_rss
from servers.fleet.local import LocalFleet
from skyrl_grpc.tiny_model import ensure_tiny_model
from trainer_client import InferenceClient

ROOT = Path(__file__).resolve().parents[1]


async def soak(stack: LocalFleet, seconds: float, workers: int) -> dict[str, float]:
    client = InferenceClient(stack.addresses.router, stack.addresses.servers, max_abort_retries=50)
    original = load_file(str(ensure_tiny_model() / "model.safetensors"))
    import torch

    generator = torch.Generator().manual_seed(0)
    other = {n: t + 0.01 * torch.randn(t.shape, generator=generator) for n, t in original.items()}
    await client.init_weight_transfer("gloo")
    stop_at = time.monotonic() + seconds
    counts = {"requests": 0, "tokens": 0, "errors": 0, "syncs": 0}
    errors: list[str] = []

    async def rollout_worker(index: int) -> None:
        rng = random.Random(index)
        while time.monotonic() < stop_at:
            length = rng.choice([4, 16, 64, 160])
            prompt = [1, *(rng.randrange(3, 2048) for _ in range(rng.randrange(1, 30)))]
            session = f"soak-{index}-{rng.randrange(8)}" if rng.random() < 0.7 else None
            try:
                if rng.random() < 0.8:
                    result = await client.generate(
                        prompt,
                        {"temperature": 1.0, "max_tokens": length, "ignore_eos": True},
                        session_id=session,
                    )
                    assert len(result.token_ids) == length, (
                        f"{len(result.token_ids)} tokens, wanted {length}"
                    )
                    counts["tokens"] += len(result.token_ids)
                else:
                    async for chunk in client.stream(
                        prompt, {"temperature": 0.0, "max_tokens": 8}, session_id=session
                    ):
                        counts["tokens"] += len(chunk.token_ids)
                counts["requests"] += 1
            except Exception as error:  # every error counts; none is expected
                counts["errors"] += 1
                errors.append(repr(error)[:300])

    async def controller() -> None:
        rng = random.Random(99)
        version = max((await client.weight_versions()).values())
        use_other = True
        while time.monotonic() < stop_at:
            await asyncio.sleep(rng.uniform(2.0, 4.0))
            try:
                await client.pause(rng.choice(["abort", "abort", "keep"]))
                version += 1
                weights = other if use_other else original
                await client.update_weights(
                    weights.items(), version, transport=rng.choice(["grpc", "collective"])
                )
                use_other = not use_other
                await client.resume()
                counts["syncs"] += 1
            except Exception as error:
                counts["errors"] += 1
                errors.append("sync: " + repr(error)[:300])
                await client.resume()

    await asyncio.gather(controller(), *(rollout_worker(i) for i in range(workers)))
    await client.resume()
    await asyncio.sleep(1.0)
    loads = await client.server_loads()
    counts["leaked"] = sum(load.running_requests + load.waiting_requests for load in loads.values())
    for line in errors[:10]:
        print("error:", line)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--warmup-seconds", type=float, default=20)
    parser.add_argument(
        "--rss-growth-mib",
        type=float,
        default=300,
        help="allowed RSS growth after warm-up, per server",
    )
    args = parser.parse_args()
    with LocalFleet(2) as stack:
        servers = stack.pids[: len(stack.addresses.servers)]
        started = time.perf_counter()
        asyncio.run(
            soak(stack, args.warmup_seconds, args.workers)
        )  # warm-up: caches, allocator pools
        rss_before = [tree_rss(pid) for pid in servers]
        counts = asyncio.run(soak(stack, args.seconds, args.workers))
        rss_after = [tree_rss(pid) for pid in servers]
        elapsed = time.perf_counter() - started
    growth = [
        (after - before) / (1 << 20) for before, after in zip(rss_before, rss_after, strict=True)
    ]
    print(f"soak: {args.seconds:.0f}s (+{args.warmup_seconds:.0f}s warm-up), {elapsed:.0f}s total")
    print(
        f"requests {counts['requests']}, tokens {counts['tokens']}, weight syncs {counts['syncs']}"
    )
    print(f"unexpected errors {counts['errors']}; leaked requests {counts['leaked']}")
    print(
        "server RSS after warm-up -> end (MiB): "
        + ", ".join(
            f"{b / (1 << 20):.0f} -> {a / (1 << 20):.0f} ({g:+.0f})"
            for b, a, g in zip(rss_before, rss_after, growth, strict=True)
        )
    )
    ok = (
        counts["errors"] == 0
        and counts["leaked"] == 0
        and all(g <= args.rss_growth_mib for g in growth)
    )
    print(
        "PASS" if ok else "FAIL",
        f"(bound: 0 errors, 0 leaked, RSS growth <= {args.rss_growth_mib:.0f} MiB per server)",
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
