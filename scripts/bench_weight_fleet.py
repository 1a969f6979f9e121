"""A weight update's cost to the trainer as the fleet grows, end to end (issue: servers relay
the stream to each other).

Fleets of N = 1, 2, 4 engine servers are started as ``skyrl-grpc up`` starts them
(``LocalFleet``), serving a model built on the spot with the project's builder (~94M and ~294M
parameters, float32: ``bench_models``). This process is the trainer: it pushes with
``InferenceClient.update_weights`` and each figure is from the call until every server serves
the new version. Side by side at every N:

- **relay**: in-band, the default: the trainer streams once, the servers relay down a chain;
- **direct**: in-band with ``weight_relay_fanout=0``: the trainer streams to every server;
- **gloo**: the collective group (``init_weight_transfer("gloo")``), full updates only.

Full updates push every parameter (``delta=False``); delta updates push the same weights with
1% of each tensor's elements changed (an RL step's patch), against the client's base. Per
update: wall seconds, the trainer's CPU seconds (this process, every thread), the bytes the
trainer sent (as ``update_weights`` returns them) over the update's bytes (what one server
received), and the servers' CPU seconds (their process trees). Ratios to N = 1 of the same
row are printed beside. ``scripts/simulate_relay.py`` reads the JSON this writes
(``--json``) to check its model against these measurements.

Run: .venv/bin/python -m scripts.bench_weight_fleet [--sizes 94m,294m] [--servers 1,2,4]
     [--rounds 3] [--json /tmp/weight_fleet.json] [--output docs/weights.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import psutil
import torch

from scripts.bench_common import ProcessTree, add_output_argument, write_report
from scripts.bench_models import BenchModel, GiB, load_model
from servers.fleet.local import LocalFleet
from trainer_client import InferenceClient

MODES = ("relay", "direct", "gloo")
IDLE_SECONDS = 3.0
# Memory one server of a model needs at most while updating, as a multiple of its bytes plus
# a fixed part (vLLM's CPU engine, the server; docs/weights.md measures them): a fleet that
# would not fit is skipped, and said so.
SERVER_FIXED_GIB = 2.5
SERVER_MODEL_COPIES = 4.5


def nudged(tensors: list[tuple[str, Any]], step: int) -> list[tuple[str, Any]]:
    """``tensors`` with 1% of each one's elements changed (another 1% each step)."""
    generator = torch.Generator().manual_seed(step)
    out = []
    for name, tensor in tensors:
        changed = torch.rand(tensor.shape, generator=generator) < 0.01
        out.append((name, torch.where(changed, tensor + 1e-3 * step, tensor)))
    return out


class Measured:
    """Per-update figures of one (size, N, mode, kind) row."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.trainer_cpu: list[float] = []
        self.server_cpu: list[float] = []
        self.sent_ratio: list[float] = []
        self.update_bytes: list[int] = []

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall": statistics.median(self.wall),
            "trainer_cpu": statistics.median(self.trainer_cpu),
            "server_cpu": statistics.median(self.server_cpu),
            "sent_ratio": max(self.sent_ratio),
            "update_bytes": statistics.median(self.update_bytes),
        }


async def timed(servers: ProcessTree, push: Any, measured: Measured) -> None:
    cpu, servers_cpu, started = time.process_time(), servers.cpu_seconds(), time.perf_counter()
    result = await push()
    measured.wall.append(time.perf_counter() - started)
    measured.trainer_cpu.append(time.process_time() - cpu)
    measured.server_cpu.append(servers.cpu_seconds() - servers_cpu)
    update = max(result.bytes_received.values())
    measured.update_bytes.append(update)
    measured.sent_ratio.append(result.bytes_sent / update)


async def measure_fleet(
    stack: LocalFleet, model: BenchModel, rounds: int
) -> dict[str, dict[str, Any]]:
    servers = list(stack.addresses.servers)
    trees = ProcessTree(*stack.pids[: len(servers)])
    # What an idle engine spends spinning, per second (vLLM's CPU engine polls): what each server
    # not busy with its own part of an update costs the others on shared cores.
    before = trees.cpu_seconds()
    await asyncio.sleep(IDLE_SECONDS)
    idle = (trees.cpu_seconds() - before) / IDLE_SECONDS / len(servers)
    rows: dict[str, dict[str, Any]] = {"idle": {"server_cpu_per_second": idle}}
    for mode in MODES:
        fanout = 0 if mode == "direct" else 1
        client = InferenceClient(stack.addresses.router, servers, weight_relay_fanout=fanout)
        transport: Literal["collective", "grpc"] = "collective" if mode == "gloo" else "grpc"
        if mode == "gloo":
            await client.init_weight_transfer("gloo")
        full = Measured()
        for _ in range(rounds):
            await timed(
                trees,
                lambda c=client, t=transport: c.update_weights(
                    model.tensors, transport=t, delta=False
                ),
                full,
            )
        rows[f"{mode} full"] = full.as_dict()
        if mode != "gloo":
            delta = Measured()
            await client.update_weights(model.tensors, transport=transport)  # the base
            for step in range(1, rounds + 1):
                weights = nudged(model.tensors, step)
                await timed(trees, lambda c=client, w=weights: c.update_weights(w), delta)
            rows[f"{mode} delta"] = delta.as_dict()
        await client.close()
        print(f"  {mode}: {rows[f'{mode} full']}", flush=True)
    return rows


def fits(model: BenchModel, servers: int) -> bool:
    """Whether ``servers`` servers and the trainer fit in memory (once the last fleet's
    memory is back)."""
    need = servers * (SERVER_FIXED_GIB * GiB + SERVER_MODEL_COPIES * model.total_bytes)
    need += 2 * model.total_bytes  # the trainer's weights and its delta base
    for _ in range(30):
        if need < psutil.virtual_memory().available:
            return True
        time.sleep(1)
    return False


def run(sizes: list[str], counts: list[int], rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for size in sizes:
        model = load_model("float32", size)
        results[size] = {"parameters": model.parameters, "bytes": model.total_bytes, "fleets": {}}
        for count in counts:
            if not fits(model, count):
                print(f"{size} x {count}: skipped, would not fit in memory", flush=True)
                continue
            print(f"{size} x {count} servers", flush=True)
            engine = ["--model", str(model.path), "--dtype", "float32", "--kv-cache-gib", "1"]
            with LocalFleet(count, engine_args=engine, on_event=lambda line: None) as stack:
                results[size]["fleets"][count] = asyncio.run(measure_fleet(stack, model, rounds))
    return results


def report(results: dict[str, Any]) -> list[str]:
    lines = [
        "| model | update | N | wall s | trainer CPU s | trainer CPU vs N=1 | sent / update "
        "| servers' CPU s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, measured in results.items():
        fleets = measured["fleets"]
        for row in ("relay full", "direct full", "gloo full", "relay delta", "direct delta"):
            first = next(iter(fleets.values()), {}).get(row)  # type: ignore[call-overload]
            for count, rows in fleets.items():
                figures = rows.get(row)
                if figures is None or first is None:
                    continue
                # What gloo's broadcast puts on the trainer's link is gloo's to say, not ours.
                sent = "—" if row.startswith("gloo") else f"{figures['sent_ratio']:.3f}"
                lines.append(
                    f"| {size} ({measured['bytes'] / 1e9:.2f} GB) | {row} | {count} "
                    f"| {figures['wall']:.2f} | {figures['trainer_cpu']:.2f} "
                    f"| {figures['trainer_cpu'] / first['trainer_cpu']:.2f}x "
                    f"| {sent} | {figures['server_cpu']:.2f} |"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="94m,294m")
    parser.add_argument("--servers", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="/tmp/weight_fleet.json")
    parser.add_argument(
        "--merge", default="", help="earlier runs' JSON files (comma-separated) to report beside"
    )
    add_output_argument(parser, "weights.md")
    args = parser.parse_args()
    counts = [int(n) for n in args.servers.split(",")]
    results: dict[str, Any] = {}
    # Earlier runs first, each fleet of a later one replacing the same fleet of an earlier one.
    for earlier in filter(None, args.merge.split(",")):
        for size, measured in json.loads(Path(earlier).read_text()).items():
            known = results.setdefault(size, {**measured, "fleets": {}})
            known["fleets"].update({int(n): rows for n, rows in measured["fleets"].items()})
    if args.sizes:
        for size, measured in run(args.sizes.split(","), counts, args.rounds).items():
            known = results.setdefault(size, {**measured, "fleets": {}})
            known["fleets"].update(measured["fleets"])
    Path(args.json).write_text(json.dumps(results, indent=1))
    lines = [
        f"Measured by `scripts/bench_weight_fleet.py` on {psutil.cpu_count()} cores: medians of "
        f"{args.rounds} updates per row; 'sent / update' is the most the trainer sent over one "
        "server's bytes.",
        "",
        *report(results),
    ]
    write_report(args.output, lines, "weight-fleet")


if __name__ == "__main__":
    main()
