"""Memory over a run of delta steps, as an RL trainer makes them (issue 44: "a run of 20 delta
steps leaves RSS flat, within 0.1x the model").

The 0.3B benchmark model (``bench_models.load_model``) is served by one engine server
started as a process; this process keeps fp32 master weights, takes Adam steps on random
gradients (``bench_models.AdamMaster``), and pushes the serving-dtype weights after each
step with ``InferenceClient.update_weights`` (deltas: only what changed since the last push),
as a trainer does. After every step it reads the servers' process-tree memory
(``bench_common.tree_memory``: anonymous memory, shared memory counted once) and this process's
own, and prints both above their level before the first step, in multiples of the model's
bytes. The verdict compares every step with the first delta step's: a leak grows step by step;
what the first delta step allocates for good (the delta base, patch buffers) is the level the
rest must hold.

Run through the one memory benchmark: .venv/bin/python -m scripts.bench_server_memory
     --delta-steps 20 [--lr 1e-6] [--dtype bfloat16] [--transport socket] [--tp 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

from scripts.bench_common import tree_memory, tree_processes, write_report
from scripts.bench_models import AdamMaster, GiB, engine_servers, load_model, own_memory

# The bound on the drift over the run, in multiples of the model's bytes.
FLAT_WITHIN = 0.1


async def soak(
    address: str,
    server_pids: list[int],
    tensors: list[tuple[str, Any]],
    steps: int,
    lr: float,
    transport: str,
) -> list[dict[str, float]]:
    """The base pushed whole, then ``steps`` delta steps; one row per push."""
    from trainer_client import InferenceClient

    client = InferenceClient(
        address, [address], direct=False, control_timeout=600, push_socket=transport == "socket"
    )
    if transport == "collective":
        await client.init_weight_transfer("gloo", timeout_seconds=600)
    await client.reserve_delta_base(tensors)
    dtype = tensors[0][1].dtype
    trainer = AdamMaster(tensors, lr, seed=int(1 / lr))
    servers_idle = sum(tree_memory(pid) for pid in server_pids)
    trainer_idle = own_memory(os.getpid())
    rows = []
    for version in range(1, steps + 2):  # version 1: the base
        if version > 1:
            trainer.step()
        serving = trainer.serving(dtype)
        started = time.perf_counter()
        await client.update_weights(
            serving, version, transport="collective" if transport == "collective" else "grpc"
        )
        seconds = time.perf_counter() - started
        del serving
        rows.append(
            {
                "step": version - 1,
                "seconds": seconds,
                "sent": max(client.last_push_bytes.values()),
                "servers": sum(tree_memory(pid) for pid in server_pids) - servers_idle,
                "trainer": own_memory(os.getpid()) - trainer_idle,
            }
        )
        # Each process's own share, printed only: where a growth is, if there is one.
        each = {
            p.pid: tree_memory(p.pid, alone=True) for s in server_pids for p in tree_processes(s)
        }
        print(rows[-1], each, flush=True)
    versions = await client.weight_versions()
    assert set(versions.values()) == {steps + 1}, versions
    await client.close()
    return rows


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    """The soak's flags (``--delta-steps`` picks it over the idle comparison)."""
    parser.add_argument("--delta-steps", type=int, default=0, help="run N delta steps instead")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--transport", default="socket", choices=["socket", "grpc", "collective"])
    parser.add_argument("--tp", type=int, default=1)


def run_soak(args: argparse.Namespace) -> None:
    """The soak with the parsed flags; its table goes to ``args.output``."""
    steps = args.delta_steps
    import torch

    model, tensors, total, parameters = load_model(args.dtype)
    torch.set_num_threads(1)
    with engine_servers(model, 1, args.tp, args.dtype) as servers:
        address = servers[0].address  # type: ignore[attr-defined]
        rows = asyncio.run(
            soak(address, [s.pid for s in servers], tensors, steps, args.lr, args.transport)
        )
    first = rows[1]  # the first delta step: what stays allocated from then on is the level
    later = rows[1:]
    # Growth past the first delta step's level (a heap given back lowers it: not a leak).
    drift_servers = max(r["servers"] - first["servers"] for r in later) / total
    drift_trainer = max(r["trainer"] - first["trainer"] for r in later) / total
    flat = drift_servers <= FLAT_WITHIN  # the issue's bound is on the servers' memory
    lines = [
        f"\n#### {steps} delta steps at lr {args.lr:g}: {parameters / 1e6:.0f}M parameters "
        f"({total / GiB:.2f} GiB {args.dtype}), one server, TP={args.tp}, {args.transport}\n",
        "Memory above each side's level before the base was pushed, in multiples of the model's "
        "bytes, after each push (step 0: the base, whole; steps 1-5, then every fifth, shown).\n",
        "| step | seconds | bytes sent (x full) | servers above idle (x model) "
        "| trainer above its start (x model) |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {r['step']:.0f} | {r['seconds']:.2f} | {r['sent'] / total:.3f} | "
            f"{r['servers'] / total:.3f} | {r['trainer'] / total:.3f} |"
            for r in rows
            if r["step"] <= 5 or r["step"] % 5 == 0 or r["step"] == steps
        ),
        "",
        f"Largest growth over step 1's level, steps 1-{steps}: servers {drift_servers:.3f}x, "
        f"trainer {drift_trainer:.3f}x the model: "
        + (
            f"the servers' memory is flat (within {FLAT_WITHIN}x)."
            if flat
            else f"the servers' memory is NOT flat (bound {FLAT_WITHIN}x)."
        ),
    ]
    block = f"delta-soak {args.dtype} tp={args.tp} {args.transport}"
    write_report(args.output, lines, block)
