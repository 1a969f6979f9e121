"""Where a weight update's memory stays, per process of one engine server (issue: weight sync
at real sizes).

Starts one engine server on the 0.3B Llama of ``bench_weight_sync`` and pushes ``--updates``
full updates from this process; prints, for every process of the server's tree, its resident
and anonymous memory right after start and after each update, and its peak while updating
(from ``/proc/PID/smaps_rollup``, sampled every 50 ms). ``bench_weight_sync`` gives the fleet's
totals against the raw links; this shows which process holds what (the gRPC server, vLLM's
engine core with this project's weight-transfer engine in its worker).

Run: .venv/bin/python -m scripts.weight_memory_per_process [--transport grpc|collective]
     [--dtype bfloat16] [--updates 4] [-- ENGINE SERVER FLAGS]
With ``-- --return-freed-memory`` the server does not ``keep_freed_memory``: freed large blocks
then go back to the system, so what stays is what is still referenced.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

from scripts.bench_models import engine_servers, load_model, perturbed

MiB = 1 << 20


def per_process(pid: int) -> dict[str, tuple[int, int]]:
    """(resident, anonymous) MiB of each process in ``pid``'s tree, by "pid name"."""
    import psutil

    root = psutil.Process(pid)
    out = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            with open(f"/proc/{process.pid}/smaps_rollup") as rollup:
                fields = {
                    line.split(":")[0]: int(line.split()[1])
                    for line in rollup
                    if line.split()[-1] == "kB"
                }
            out[f"{process.pid} {process.name()[:20]}"] = (
                fields.get("Rss", 0) // 1024,
                fields.get("Anonymous", 0) // 1024,
            )
        except (OSError, psutil.NoSuchProcess):
            pass
    return out


def sample(pid: int, peaks: dict[str, int], done: threading.Event) -> None:
    """Keeps each process's peak resident MiB in ``peaks`` until ``done``."""
    while not done.is_set():
        for name, (rss, _) in per_process(pid).items():
            peaks[name] = max(peaks.get(name, 0), rss)
        time.sleep(0.05)


async def run(transport: str, dtype: str, updates: int, server_args: list[str]) -> None:
    from trainer_client import InferenceClient

    model, tensors, total, _ = load_model(dtype)
    print(f"model: {total // MiB} MiB {dtype}")
    with engine_servers(model, 1, 1, dtype, server_args) as (server,):
        address: str = server.address  # type: ignore[attr-defined]
        print("after start (MiB resident, anonymous):", per_process(server.pid))
        client = InferenceClient(address, [address], direct=False, control_timeout=600)
        if transport == "collective":
            await client.init_weight_transfer("gloo", timeout_seconds=600)
        for version in range(1, updates + 1):
            new = perturbed(tensors, seed=version)
            peaks: dict[str, int] = {}
            done = threading.Event()
            sampler = threading.Thread(target=sample, args=(server.pid, peaks, done))
            sampler.start()
            started = time.perf_counter()
            await client.update_weights(new, version, transport=transport, timeout=1800)  # type: ignore[arg-type]
            seconds = time.perf_counter() - started
            done.set()
            sampler.join()
            print(f"update {version} ({seconds:.2f} s): peak resident MiB {peaks}")
            print("    after:", per_process(server.pid))
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", default="grpc", choices=["grpc", "collective"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument(
        "server_args", nargs="*", help="after --: engine server flags (--return-freed-memory)"
    )
    args = parser.parse_args()
    asyncio.run(run(args.transport, args.dtype, args.updates, args.server_args))


if __name__ == "__main__":
    main()
