"""What an engine server holds, per process, against vLLM's own server on the same model (issue:
servers relay the stream to each other, item 7).

The ~294M float32 benchmark model (``bench_models``) is served by vLLM's own OpenAI server and
by this project's engine server (with the same engine settings: KV cache, eager mode), each
started as a process; every process's unique memory (USS: what would be freed if it exited)
is read once the server is idle, and for this project's server again after a trainer's first
rollout (where, by default, it prepares for updates: ``--weight-staging``), after a full update
(the previous weights kept for a rollback), after one with ``release_memory=True``, and while
updating (the peak, sampled). The server runs with each ``--weight-staging``. The target:
vLLM's own plus 1.1x the model's bytes (the checkpoint copy exact deltas need); the first
update <= 1.2x the second.

With ``--delta-steps N`` it measures memory over a run of N delta steps instead
(``scripts/memory_soak.py``: does a long run leave the servers' memory flat?).

Run: .venv/bin/python -m scripts.bench_server_memory [--size 294m] [--output docs/weights.md]
     .venv/bin/python -m scripts.bench_server_memory --delta-steps 20 [--lr 1e-6] [--dtype ...]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil
import torch

from scripts.bench_common import (
    add_output_argument,
    write_report,
)
from scripts.bench_models import BenchModel, engine_servers, load_model
from scripts.memory_soak import add_soak_arguments, run_soak
from testbed.peers import vllm_http_server

GB = 1e9


def role(process: psutil.Process) -> str:
    command = " ".join(process.cmdline())
    if "EngineCore" in command or process.name().startswith("VLLM"):
        return "engine core"
    if "forkserver" in command:
        return "forkserver"
    if "resource_tracker" in command:
        return "resource tracker"
    if "servers.engine" in command:
        return "server (gRPC)"
    if "api_server" in command:
        return "server (HTTP)"
    return str(process.name())


def unique_memory(pid: int) -> dict[str, int]:
    """USS of every process in ``pid``'s tree, by role."""
    out: dict[str, int] = {}
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            out[role(process)] = out.get(role(process), 0) + process.memory_full_info().uss
        except psutil.NoSuchProcess:
            pass
    return out


def settle(pid: int) -> dict[str, int]:
    """The tree's USS once it stops changing (an idle engine's last allocations land)."""
    previous: dict[str, int] = {}
    for _ in range(20):
        now = unique_memory(pid)
        if previous and abs(sum(now.values()) - sum(previous.values())) < 20e6:
            return now
        previous = now
        time.sleep(0.5)
    return previous


class Peak:
    """The tree's largest total USS while it runs (sampled every 100 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._done = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.1):
            self.peak = max(self.peak, sum(unique_memory(self.pid).values()))

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def nudged(tensors: list[tuple[str, torch.Tensor]], seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(n, t + 1e-3 * torch.randn(t.shape, generator=generator)) for n, t in tensors]


ROLLOUT = {"max_tokens": 64, "temperature": 1.0, "ignore_eos": True}
ROLLOUT_PROMPTS = 16


async def rollout(client: Any, seed: int) -> float:
    """A trainer's rollout (16 prompts x 64 sampled tokens, one batch); its seconds."""
    prompts = [[1, 450 + seed, 700 + i] for i in range(ROLLOUT_PROMPTS)]
    started = time.perf_counter()
    results = await client.generate_batch(prompts, ROLLOUT)
    assert all(len(r.token_ids) == ROLLOUT["max_tokens"] for r in results)
    return time.perf_counter() - started


async def ours(
    model: BenchModel, flags: Sequence[str]
) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
    """Each state's memory, and the seconds of a new trainer's first two rollouts and first
    two full updates (no ``reserve_delta_base``), in a trainer's order: rollout, update."""
    from trainer_client import InferenceClient

    states: dict[str, dict[str, int]] = {}
    seconds: dict[str, float] = {}
    with engine_servers(model.path, 1, 1, "float32", flags) as (server,):
        address: str = server.address  # type: ignore[attr-defined]
        states["idle after start"] = settle(server.pid)
        client = InferenceClient(address, [address], direct=False)
        # Timed, nothing sampled meanwhile: every element of each update changed.
        for step in range(2):
            seconds[f"rollout {step + 1}"] = await rollout(client, step)
            if not step:
                states["after the first rollout"] = settle(server.pid)
            weights = nudged(model.tensors, step)
            started = time.perf_counter()
            await client.update_weights(weights)
            seconds[f"update {step + 1}"] = time.perf_counter() - started
            if not step:
                states["after a full update"] = settle(server.pid)
        peak = Peak(server.pid)
        await client.update_weights(nudged(model.tensors, 2), delta=False, release_memory=True)
        states["peak while updating"] = {"total": peak.stop()}
        states["after one with release_memory=True"] = settle(server.pid)
        await client.close()
    return states, seconds


def theirs(model: BenchModel) -> dict[str, int]:
    with vllm_http_server(model=model.path) as launched:
        return settle(launched.process.pid)


def report(
    model: BenchModel, vllm: dict[str, int], runs: dict[str, Any], timings: dict[str, Any]
) -> list[str]:
    target = sum(vllm.values()) + 1.1 * model.total_bytes
    roles = ["server (HTTP)", "server (gRPC)", "forkserver", "engine core", "resource tracker"]
    lines = [
        f"Model: {model.parameters / 1e6:.0f}M parameters, float32, {model.total_bytes / GB:.2f} "
        f"GB. Target: vLLM's own + 1.1x the model = {target / GB:.2f} GB.",
        "",
        "| server | state | " + " | ".join(roles) + " | total GB | vs target |",
        "|---|---|" + "---|" * len(roles) + "---|---|",
    ]

    def row(name: str, state: str, memory: dict[str, int]) -> str:
        total = memory.get("total", sum(memory.values()))
        cells = " | ".join(f"{memory[r] / GB:.2f}" if r in memory else "" for r in roles)
        return f"| {name} | {state} | {cells} | {total / GB:.2f} | {total / target:.2f}x |"

    lines.append(row("vLLM's own", "idle after start", vllm))
    for name, states in runs.items():
        for state, memory in states.items():
            lines.append(row(name, state, memory))
    lines += [
        "",
        "| server | first rollout s | second s | first / second | first full update s | "
        "second s | first / second |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, t in timings.items():
        lines.append(
            f"| {name} | {t['rollout 1']:.2f} | {t['rollout 2']:.2f} | "
            f"{t['rollout 1'] / t['rollout 2']:.2f}x | {t['update 1']:.2f} | "
            f"{t['update 2']:.2f} | {t['update 1'] / t['update 2']:.2f}x |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="294m")
    add_output_argument(parser, "weights.md")
    add_soak_arguments(parser)
    args = parser.parse_args()
    if args.delta_steps:
        run_soak(args)
        return
    model = load_model("float32", args.size)
    vllm = theirs(model)
    runs: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    for name, flags in (
        ("this project's (--weight-staging first-generation)", []),
        ("--weight-staging start", ["--weight-staging", "start"]),
        ("--weight-staging first-update", ["--weight-staging", "first-update"]),
        ("--no-preload-engine-core", ["--no-preload-engine-core"]),
    ):
        runs[name], timings[name] = asyncio.run(ours(model, flags))
    lines = [
        "Measured by `scripts/bench_server_memory.py`: unique memory (USS) per process, GB; "
        "then a new trainer's first two steps, each a rollout (16 prompts x 64 sampled tokens) "
        "and a full update (client defaults).",
        "",
        *report(model, vllm, runs, timings),
    ]
    write_report(args.output, lines, "server-memory")


if __name__ == "__main__":
    main()
