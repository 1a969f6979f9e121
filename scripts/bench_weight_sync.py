"""Weight sync as the trainer waits for it, end to end, at a size people train (issue: weight
sync at real sizes).

A Llama of ~0.3B parameters is built on the spot with the project's own builder
(``skyrl_grpc.tiny_model``), served by real engine servers started as processes
(``python -m servers.engine --model DIR``), and updated through ``InferenceClient.update_weights``
from this process: each figure is from the call until every server serves the new version.
Beside them, in the same run, the floors: the raw links for the same bytes (a loopback TCP
socket, and a gloo broadcast between two fresh processes) and vLLM's own reload of the whole
model from the server's memory with no transport (R: a rollback of each full update, which
swaps the previous weights back in and reloads every layer). Full updates with
``release_memory=True`` (the previous weights freed once the fleet committed) run back to back
beside them. Every row prints its ratio to its floor, the link's time for the bytes it sent
plus R; in-band rows also to a bare gRPC stream of the same chunks plus R (``grpc_floor``).
Also measured: the servers' process-tree memory above its level right after start (anonymous
memory, and shared memory such as the checkpoint copy all tensor-parallel ranks map counted
once: ``process_memory.memory_of``; peak while updating, and what stays), this trainer's own peak
extra memory, and the CPU seconds of the trainer and of the servers per update. The trainer
reserves its delta base at its start (``reserve_delta_base``), as the docs advise.

RL-like steps (``--rl-lrs``): the trainer keeps fp32 master weights and takes Adam steps on
random gradients at each learning rate; the servers serve the master weights cast to the
serving dtype, pushed with ``update_weights`` (deltas: only what changed since the last push).

Run: .venv/bin/python -m scripts.bench_weight_sync [--servers 1] [--tp 1] [--rounds 2]
     [--dtype bfloat16] [--transports socket,grpc,collective] [--rl-lrs 1e-6,1e-5]
     [--output docs/weights.md]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from scripts.bench_common import (
    ProcessTree,
    add_output_argument,
    cpu_seconds,
    tree_memory,
    tree_processes,
    write_report,
)
from scripts.bench_models import (
    MODELS,
    AdamMaster,
    GiB,
    engine_servers,
    load_model,
    own_memory,
    perturbed,
)
from scripts.grpc_floor import raw_grpc
from scripts.process_memory import PeakMemory

ROOT = Path(__file__).resolve().parents[1]

# -- raw links ----------------------------------------------------------------------------------


def raw_tcp(tensors: list[tuple[str, Any]], chunk: int = 4 << 20) -> float:
    """Seconds to send every tensor's bytes over one loopback TCP connection (the socket
    measurement of ``bench_weights``, fed views of the tensors' own memory)."""
    import torch

    from scripts.bench_common import raw_tcp as send_over_tcp

    views = [memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) for _, t in tensors]
    return send_over_tcp([v[o : o + chunk] for v in views for o in range(0, len(v), chunk)])


def _gloo_receiver(port: int, sizes: list[int], rounds: int, done: Any) -> None:
    import torch

    from skyrl_grpc.process_group import join_group

    group = join_group("gloo", "127.0.0.1", port, 1, 2, "bench-raw-gloo", 120)
    # Received into the same buffers every round, as a server receives into its staging memory
    # (made at its start): a fresh buffer per broadcast would time page faults, not the link.
    buffers = [torch.ones(size, dtype=torch.uint8) for size in sizes]
    for _ in range(rounds):
        for buffer in buffers:
            group.broadcast(buffer, 0).wait()
        done.put(0)


def raw_gloo(tensors: list[tuple[str, Any]], rounds: int) -> float:
    """Best seconds of a gloo broadcast of every tensor (one broadcast each) to a fresh process,
    after a warm-up round."""
    import torch

    from skyrl_grpc.process_group import free_port
    from trainer_client.weights.weight_sending import CollectiveSender

    port = free_port("127.0.0.1")
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    context = multiprocessing.get_context("spawn")
    done = context.Queue()
    receiver = context.Process(target=_gloo_receiver, args=(port, sizes, rounds + 1, done))
    receiver.start()
    sender = CollectiveSender("gloo", "127.0.0.1", port, 2, "bench-raw-gloo", 120)
    sender.join()
    best = float("inf")
    for round_index in range(rounds + 1):
        started = time.perf_counter()
        for _, tensor in tensors:
            sender.group.broadcast(tensor.contiguous().view(-1).view(torch.uint8), 0).wait()
        done.get(timeout=300)
        if round_index:
            best = min(best, time.perf_counter() - started)
    receiver.join()
    sender.release()
    return best


def timed_cpu(measure: Callable[[], float]) -> tuple[float, float]:
    """What ``measure`` returns (seconds) and the CPU seconds this process spent in it."""
    before = cpu_seconds(psutil.Process())
    seconds = measure()
    return seconds, cpu_seconds(psutil.Process()) - before


# -- the update the trainer waits for -----------------------------------------------------------


async def updates(
    servers: list[subprocess.Popen[str]],
    tensors: list[tuple[str, Any]],
    transports: list[str],
    rounds: int,
    rl_lrs: list[float],
    compressions: list[bool],
) -> tuple[list[dict[str, Any]], list[tuple[float, float]]]:
    """Every update measured (one row each), and the reload floors (seconds and the servers'
    CPU seconds, one per full update: ``reload_floor``)."""
    from trainer_client import InferenceClient

    addresses = [s.address for s in servers]  # type: ignore[attr-defined]
    client = InferenceClient(addresses[0], addresses, direct=False, control_timeout=600)
    # In-band over gRPC only: the same client without the servers' push sockets.
    grpc_client = InferenceClient(
        addresses[0], addresses, direct=False, control_timeout=600, push_socket=False
    )
    # As a trainer does at its start: the first update copies into this instead of faulting in
    # fresh memory for the base of the next delta (in the trainer's memory before every update).
    await client.reserve_delta_base(tensors)
    if "grpc" in transports:
        await grpc_client.reserve_delta_base(tensors)
    pids = [s.pid for s in servers]
    idle = sum(tree_memory(p) for p in pids)
    server_processes = [p.pid for pid in pids for p in tree_processes(pid)]
    full = sum(t.numel() * t.element_size() for _, t in tensors)
    rows = []
    version = 0

    async def measure(
        label: str,
        new: list[tuple[str, Any]],
        transport: str,
        compress: bool = False,
        release_memory: bool = False,
    ) -> None:
        nonlocal version
        trainer_before = own_memory(os.getpid())
        # The trainer's CPU is this process's alone: the servers are its children.
        trainer_cpu, servers_cpu = psutil.Process(), ProcessTree(*pids)
        cpu_before = cpu_seconds(trainer_cpu), servers_cpu.cpu_seconds()
        version += 1
        with (
            PeakMemory(server_processes) as servers_peak,
            PeakMemory([os.getpid()]) as trainer_peak,
        ):
            started = time.perf_counter()
            sender = grpc_client if transport == "grpc" else client
            await sender.update_weights(
                new,
                version,
                transport="collective" if transport == "collective" else "grpc",
                timeout=1800,
                compress_patches=compress,
                release_memory=release_memory,
            )
            seconds = time.perf_counter() - started
        cpu = cpu_seconds(trainer_cpu) - cpu_before[0], servers_cpu.cpu_seconds() - cpu_before[1]
        versions = await client.weight_versions()
        assert set(versions.values()) == {version}, versions
        sent = max(sender.last_push_bytes.values())
        rows.append(
            {
                "update": label,
                "transport": transport,
                "seconds": seconds,
                "wire_fraction": sent / full,
                "servers_peak_above_idle": servers_peak.peak - idle,
                "servers_kept_above_idle": sum(tree_memory(p) for p in pids) - idle,
                "trainer_peak_extra": trainer_peak.peak - trainer_before,
                "cpu_trainer": cpu[0],  # this process (the memory samplers are processes)
                "cpu_servers": cpu[1],
            }
        )
        print(rows[-1], flush=True)

    async def reload_floor(transport: str) -> None:
        """The floor of an update with no transport: vLLM reloading the same model from the
        server's own memory, timed as a rollback of the full update just committed (the
        previous weights are there; the rollback swaps them in and reloads every layer)."""
        nonlocal version
        servers_cpu = ProcessTree(*pids)
        cpu_before = servers_cpu.cpu_seconds()
        started = time.perf_counter()
        restored = await client.rollback_weights(version, timeout=1800)
        floors.append((time.perf_counter() - started, servers_cpu.cpu_seconds() - cpu_before))
        assert len(set(restored.values())) == 1 and min(restored.values()) < version, restored
        print(
            {"reload floor (rollback), s and CPU s": floors[-1], "transport": transport}, flush=True
        )

    floors: list[tuple[float, float]] = []
    for transport in transports:
        if transport == "collective":
            await client.init_weight_transfer("gloo", timeout_seconds=600)
        for round_index in range(rounds):
            new = perturbed(tensors, seed=version + 1)  # the trainer's weights, made before
            await measure(f"full {round_index + 1}", new, transport)
            del new
            await reload_floor(transport)
    # Back to back, as a trainer updating every step: each server frees its rollback copy once
    # the fleet committed and gives the memory back, so the next update faults in fresh pages.
    # After every transport's own rows: a transport's first update must not pay for memory an
    # earlier transport's release gave back.
    for transport in transports:
        for round_index in range(rounds):
            new = perturbed(tensors, seed=version + 1)
            label = f"full {round_index + 1}, release_memory"
            await measure(label, new, transport, release_memory=True)
            del new
    dtype = tensors[0][1].dtype
    for transport in transports:
        for lr in rl_lrs:
            for compress in compressions:
                kind = f"RL lr {lr:g}{' zstd' if compress else ''}"
                trainer = AdamMaster(tensors, lr, seed=int(1 / lr))
                await measure(f"{kind}: base", trainer.serving(dtype), transport, compress)
                for step in range(rounds):
                    trainer.step()
                    serving = trainer.serving(dtype)
                    await measure(f"{kind}: step {step + 1}", serving, transport, compress)
                del trainer
    await client.close()
    await grpc_client.close()
    return rows, floors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--transports",
        default="socket,grpc,collective",
        help="in-band over the servers' push sockets (socket), in-band over gRPC alone (grpc), "
        "the gloo collective (collective)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--model",
        default="294m",
        choices=sorted(MODELS),
        help="the benchmark model (scripts/bench_models.py); 94m-moe: the 94m model's bytes as "
        "a mixture of experts, against 94m for the dense layout",
    )
    parser.add_argument("--rl-lrs", default="1e-6,1e-5", help="learning rates of RL-like steps")
    parser.add_argument(
        "--patch-compression",
        default="none",
        help="RL steps with patches as they are (none), zstd-compressed (zstd), or both "
        "(none,zstd: the same steps twice, side by side)",
    )
    add_output_argument(parser, "weights.md")
    args = parser.parse_args()

    import torch

    model, tensors, total, parameters = load_model(args.dtype, args.model)
    print(f"model: {parameters / 1e6:.0f}M parameters, {total / GiB:.2f} GiB {args.dtype}")
    torch.set_num_threads(1)
    # The fastest round, with the CPU it took (sender and receiver are both this process).
    tcp, tcp_cpu = min(timed_cpu(lambda: raw_tcp(tensors)) for _ in range(args.rounds))
    gloo = raw_gloo(tensors, args.rounds)
    transports = [t for t in args.transports.split(",") if t]
    stream = raw_grpc(tensors, args.rounds) if "grpc" in transports else None
    print(f"raw loopback TCP {tcp:.2f} s, raw gloo broadcast {gloo:.2f} s, {stream}", flush=True)
    rl_lrs = [float(x) for x in args.rl_lrs.split(",") if x]
    compressions = [c == "zstd" for c in args.patch_compression.split(",") if c]
    with engine_servers(model, args.servers, args.tp, args.dtype) as servers:
        rows, floors = asyncio.run(
            updates(servers, tensors, transports, args.rounds, rl_lrs, compressions)
        )
    reload_floor = statistics.median(f for f, _ in floors) if floors else 0.0
    reload_cpu = statistics.median(c for _, c in floors) if floors else 0.0
    lines = [
        f"\n#### {parameters / 1e6:.0f}M parameters ({total / GiB:.2f} GiB {args.dtype}"
        f"{', a mixture of experts' if MODELS[args.model].get('num_experts') else ''}), "
        f"{args.servers} server(s), TP={args.tp}\n",
        f"Floors, same run: loopback TCP of the full bytes {tcp:.2f} s ({tcp_cpu:.2f} s of CPU, "
        f"sender and receiver), gloo broadcast {gloo:.2f} s, vLLM's reload of the whole model "
        f"from the server's memory (R, a rollback after each full update) {reload_floor:.2f} s "
        f"(median of {', '.join(f'{f:.2f}' for f, _ in floors)}; {reload_cpu:.2f} s of the "
        f"servers' CPU, median). An update's floor: the link's time for the bytes it sent, plus "
        f"R. On {os.cpu_count()} cores the in-band floor (TCP + R) already spends "
        f"{tcp_cpu + reload_cpu:.2f} s of CPU in {tcp + reload_floor:.2f} s.\n",
        *(
            [
                f"The same chunks as a bare gRPC stream (`scripts/grpc_floor.py`: nothing done "
                f"to them) {stream.seconds:.2f} s, {stream.client_cpu_seconds:.2f} s of the "
                f"sender's CPU and {stream.server_cpu_seconds:.2f} s of the receiver's: an "
                "in-band update's floor through gRPC is that plus R (column x gRPC floor).\n"
            ]
            if stream
            else []
        ),
        "| update | transport | seconds | floor s | x floor | x gRPC floor | bytes sent (x full) "
        "| servers' peak above idle (x model) | kept above idle (x model) "
        "| trainer's peak extra (x model) | CPU s: trainer, servers |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        link = gloo if row["transport"] == "collective" else tcp
        floor = link * row["wire_fraction"] + reload_floor
        by_grpc = "-"
        if stream and row["transport"] == "grpc":
            by_grpc = (
                f"{row['seconds'] / (stream.seconds * row['wire_fraction'] + reload_floor):.2f}x"
            )
        lines.append(
            f"| {row['update']} | {row['transport']} | {row['seconds']:.2f} | {floor:.2f} | "
            f"{row['seconds'] / floor:.2f}x | {by_grpc} | {row['wire_fraction']:.3f} | "
            f"{row['servers_peak_above_idle'] / total:.2f} | "
            f"{row['servers_kept_above_idle'] / total:.2f} | "
            f"{row['trainer_peak_extra'] / total:.2f} | "
            f"{row['cpu_trainer']:.2f}, {row['cpu_servers']:.2f} |"
        )
    block = f"bench_weight_sync {args.dtype} servers={args.servers} tp={args.tp}"
    if args.model != "294m":  # the default's block keeps its name
        block += f" model={args.model}"
    write_report(args.output, lines, block)


if __name__ == "__main__":
    main()
