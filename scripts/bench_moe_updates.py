"""What a weight update into a mixture of experts costs against a dense model of the same bytes
(issue 79: exact updates into vLLM's fused expert layout): the 94M benchmark Llama and the same
bytes in Mixtral's architecture (each layer's MLP as 4 experts of a quarter of its width, top-2,
which vLLM's CPU build runs from fused, prepacked expert tensors), one engine server each, full
in-band updates over the push socket (``bench_weight_sync``'s measurement, its floors beside
it: vLLM's own reload of the whole model from the server's memory, R), the two models taking
turns round by round.

Run: .venv/bin/python -m scripts.bench_moe_updates [--rounds 3] [--output docs/weights.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from scripts.bench_common import add_output_argument, median_range, write_report
from scripts.bench_models import engine_servers, load_model
from scripts.bench_weight_sync import updates

MODELS = {"dense": "94m", "mixture of experts": "94m-moe"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    add_output_argument(parser, "weights.md")
    args = parser.parse_args()
    loaded = {name: load_model("float32", size) for name, size in MODELS.items()}
    seconds: dict[str, list[float]] = {name: [] for name in MODELS}
    reloads: dict[str, list[float]] = {name: [] for name in MODELS}
    cpu: dict[str, list[float]] = {name: [] for name in MODELS}
    for round_index in range(args.rounds):
        order = list(MODELS) if round_index % 2 == 0 else list(MODELS)[::-1]
        for name in order:
            model = loaded[name]
            with engine_servers(model.path, 1, 1, "float32") as servers:
                rows, floors = asyncio.run(updates(servers, model.tensors, ["socket"], 2, [], []))
            plain = [
                r for r in rows if r["update"].startswith("full") and "release" not in r["update"]
            ]
            seconds[name] += [r["seconds"] for r in plain]
            cpu[name] += [r["cpu_servers"] for r in plain]
            reloads[name] += [f for f, _ in floors]
            print(f"round {round_index + 1} {name}: {[round(r['seconds'], 2) for r in plain]}")
    bytes_of = {name: loaded[name].total_bytes for name in MODELS}
    lines = [
        f"A full in-band update (push socket) into one server, the 94M Llama against the same "
        f"bytes as a mixture of experts (4 experts a layer, top-2; {bytes_of['dense'] / 2**30:.3f}"
        f" and {bytes_of['mixture of experts'] / 2**30:.3f} GiB float32), the two taking turns "
        f"over {args.rounds} rounds of 2 updates each (`python -m scripts.bench_moe_updates`; "
        "medians, ranges in brackets):",
        "",
        "| model | update s | vLLM's reload of the whole model (R) s | servers' CPU s per update |",
        "| --- | --- | --- | --- |",
    ]
    for name in MODELS:
        lines.append(
            f"| {name} | {median_range(seconds[name])} | {median_range(reloads[name])} | "
            f"{median_range(cpu[name])} |"
        )
    ratio = statistics.median(seconds["mixture of experts"]) / statistics.median(seconds["dense"])
    reload = statistics.median(reloads["mixture of experts"]) / statistics.median(reloads["dense"])
    lines += ["", f"Mixture of experts / dense: update **{ratio:.2f}x**, R {reload:.2f}x."]
    write_report(args.output, lines, "moe-updates")


if __name__ == "__main__":
    main()
