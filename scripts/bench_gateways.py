"""SMG, the Rust gateway, over this stack's engine server (vLLM's ``VllmEngine`` protocol it also
serves) against SMG over vLLM's own gRPC server (``vllm serve --grpc``), and this stack's own
OpenAI edge beside both: one engine each on the embedded model, the same engine settings,
under vLLM's own load generator (``vllm bench serve``: 256 random prompts of 128 tokens, 128
out, concurrency 64), rounds interleaved with the idle targets frozen; each gateway's CPU
seconds per 1000 output tokens (SMG's process, or this stack's router).

Run: .venv/bin/python -m scripts.bench_gateways [--rounds 3] [--output docs/performance.md]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from scripts.bench_common import (
    ProcessTree,
    add_output_argument,
    median_range,
    thaw_all,
    vllm_grpc_server,
    write_report,
)
from scripts.bench_edge import EdgeTarget, serve_rounds
from servers.engine.options import TINY_MODEL_NAME
from servers.fleet.local import LocalFleet
from skyrl_grpc.process_group import free_port
from testbed.peers import Launched, launched_process

SMG_START_SECONDS = 120.0
VLLM = "SMG over vLLM's gRPC server"
OURS = "SMG over this server"
EDGE = "this stack's edge"


@contextlib.contextmanager
def smg_gateway(worker: str) -> Iterator[tuple[Launched, str, str]]:
    """``smg launch`` over the gRPC ``worker``: its process, base URL and the model it lists."""
    port, metrics = free_port("127.0.0.1"), free_port("127.0.0.1")
    command = [str(Path(sys.executable).with_name("smg")), "launch", "--worker-urls"]
    command += [f"grpc://{worker}", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--prometheus-port", str(metrics), "--log-level", "error"]
    with launched_process(command, None, "smg") as gateway:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SMG_START_SECONDS
        while True:  # up, and the worker's model registered
            if gateway.process.poll() is not None:
                raise RuntimeError(f"smg over {worker} exited; see {gateway.log}")
            with contextlib.suppress(httpx.HTTPError, ValueError, IndexError, KeyError):
                model = str(httpx.get(f"{base}/v1/models", timeout=2).json()["data"][0]["id"])
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg over {worker} listed no model; see {gateway.log}")
            time.sleep(0.2)
        yield gateway, base, model


def report(rounds: int, results: dict[str, list[dict[str, float]]], order: str) -> list[str]:
    lines = [
        "Gateways under `vllm bench serve` (256 random prompts, 128 in / 128 out, concurrency "
        f"64, `--ignore-eos`), one engine each on the embedded model, {rounds} rounds "
        f"interleaved, the idle targets frozen, {order} (`python -m scripts.bench_gateways`):",
        "",
        "| target | output tok/s | mean ITL (ms) | p99 ITL (ms) | p99 TTFT (ms) | gateway CPU s "
        "/ 1k tokens |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    keys = ["output_tok_s", "mean_itl_ms", "p99_itl_ms", "p99_ttft_ms", "routing_cpu_per_1k"]
    for name, figures in results.items():
        cells = [median_range([f[k] for f in figures], 3 if "cpu" in k else 1) for k in keys]
        lines.append(f"| {name} | {' | '.join(cells)} |")

    def ratio(name: str, key: str) -> float:
        pairs = zip(results[name], results[VLLM], strict=True)
        return statistics.median(ours[key] / theirs[key] for ours, theirs in pairs)

    lines += ["", f"Against {VLLM} (median of per-round ratios):", ""]
    for name in (OURS, EDGE):
        lines.append(
            f"- {name}: output tokens/s {ratio(name, 'output_tok_s'):.3f}, p99 ITL "
            f"{ratio(name, 'p99_itl_ms'):.3f}, gateway CPU per token "
            f"{ratio(name, 'routing_cpu_per_1k'):.3f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--this-server-first",
        action="store_true",
        help="start this stack's server before vLLM's (default: after it), to see whether "
        "the order matters (on this 2-core VM: within the spread between runs)",
    )
    add_output_argument(parser, "performance.md")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        trees: list[ProcessTree] = []
        started: dict[str, EdgeTarget] = {}
        stack.callback(thaw_all, trees)

        def start_vllm() -> None:
            served: Any = stack.enter_context(vllm_grpc_server())
            gateway, base, model = stack.enter_context(smg_gateway(served.address))
            tree = ProcessTree(served.process.pid, gateway.process.pid)
            started[VLLM] = EdgeTarget(tree, base, model, ProcessTree(gateway.process.pid))
            trees.append(tree)
            tree.freeze()

        def start_ours() -> None:
            fleet = stack.enter_context(LocalFleet(1, router_args=["--http-port", "0"]))
            gateway, base, model = stack.enter_context(smg_gateway(fleet.addresses.servers[0]))
            tree = ProcessTree(*fleet.pids, gateway.process.pid)
            started[OURS] = EdgeTarget(tree, base, model, ProcessTree(gateway.process.pid))
            edge = f"http://127.0.0.1:{fleet.http_port}"
            started[EDGE] = EdgeTarget(tree, edge, TINY_MODEL_NAME, ProcessTree(fleet.pids[-1]))
            trees.append(tree)
            tree.freeze()

        for start in (
            (start_ours, start_vllm) if args.this_server_first else (start_vllm, start_ours)
        ):
            start()
        targets = {name: started[name] for name in (VLLM, OURS, EDGE)}
        results = serve_rounds(args.rounds, targets)
    order = "this stack's server first" if args.this_server_first else "vLLM's server first"
    write_report(args.output, report(args.rounds, results, order), "gateways")


if __name__ == "__main__":
    main()
