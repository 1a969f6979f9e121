"""LoRA adapters, side by side in one run (issue: LoRA adapters end to end).

1. Time to load one adapter (rank 8 on all seven projections of the embedded tiny model) on
   1, 2 and 4 engine servers at once: pushed in-band (``client.load_lora(tensors=...)``: CRC-32
   chunks, SHA-256 per tensor, no shared filesystem) vs loaded from a directory on the servers
   (``client.load_lora(path=...)``, the shared-filesystem way; the directory is written once
   beforehand and not timed). Median of ``--repeats`` loads, each a new version of the same name.
2. Generation throughput at 64 concurrent streams through the router, with the adapter vs the
   base model, alternating rounds.

Run: .venv/bin/python -m scripts.bench_lora [--repeats 5] [--output docs/training.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench_common import add_output_argument, write_report
from servers.engine.domain.lora_adapters import AdapterConfig, ModelShapes
from servers.fleet.local import LocalFleet
from skyrl_grpc.tiny_model import ensure_tiny_model
from trainer_client import InferenceClient

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter(rank: int = 8) -> tuple[dict[str, Any], dict[str, Any]]:
    """Random factors for every tensor the server expects of such an adapter (its own naming
    and shapes, ``servers.engine.domain.lora_adapters``)."""
    import torch

    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(MODULES)}
    model = json.loads((ensure_tiny_model() / "config.json").read_text())
    shapes = ModelShapes.from_config(model)
    expected = AdapterConfig.parse(json.dumps(config), rank, shapes).expected(shapes)
    tensors = {name: torch.randn(*shape) / 10 for name, shape in expected.items()}
    return tensors, config


async def load_times(
    client: InferenceClient,
    tensors: dict[str, Any],
    config: dict[str, Any],
    path: str,
    repeats: int,
) -> dict[str, float]:
    times: dict[str, list[float]] = {"in-band": [], "path": []}
    for _ in range(repeats):
        for how in times:
            started = time.perf_counter()
            if how == "in-band":
                await client.load_lora("bench", tensors=tensors, config=config)
            else:
                await client.load_lora("bench", path=path)
            times[how].append(time.perf_counter() - started)
    return {how: statistics.median(t) for how, t in times.items()}


async def throughput(client: InferenceClient, lora: str, streams: int, tokens: int) -> float:
    prompts = [[1] + [3 + (i * 31 + k * 7) % 2000 for k in range(15)] for i in range(streams)]
    sampling = {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}
    started = time.perf_counter()
    results = await client.generate_batch(prompts, sampling, lora=lora)
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - started)


async def run(args: argparse.Namespace) -> list[str]:
    tensors, config = adapter()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    directory = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    from safetensors.torch import save_file

    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(config))
    lines = [
        "### Loading adapters and serving with them (`python -m scripts.bench_lora`)",
        "",
        f"Adapter: rank {config['r']} on {', '.join(MODULES)} of the embedded tiny model "
        f"({len(tensors)} tensors, {size / 1024:.0f} KiB). Median of {args.repeats} loads.",
        "",
        "| servers | in-band push (ms) | load from a server path (ms) | in-band / path |",
        "| --- | --- | --- | --- |",
    ]
    engine_args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    with LocalFleet(4, engine_args=engine_args) as fleet:
        servers = list(fleet.addresses.servers)
        for count in (1, 2, 4):
            client = InferenceClient(fleet.addresses.router, servers[:count])
            await load_times(client, tensors, config, str(directory), 1)  # warm
            median = await load_times(client, tensors, config, str(directory), args.repeats)
            lines.append(
                f"| {count} | {median['in-band'] * 1e3:.1f} | {median['path'] * 1e3:.1f} "
                f"| {median['in-band'] / median['path']:.2f}x |"
            )
            print(lines[-1], flush=True)
            await client.close()
        client = InferenceClient(fleet.addresses.router, servers)
        await client.load_lora("bench", tensors=tensors, config=config)
        await throughput(client, "", 16, 16)  # warm
        rates: dict[str, list[float]] = {"base model": [], "adapter": []}
        for _ in range(args.rounds):
            for name, lora in (("base model", ""), ("adapter", "bench")):
                rates[name].append(await throughput(client, lora, 64, args.max_tokens))
        base, with_adapter = (statistics.median(rates[k]) for k in ("base model", "adapter"))
        lines += [
            "",
            f"Generation, 64 concurrent streams x {args.max_tokens} tokens through the router "
            f"over 4 LoRA-enabled servers, median of {args.rounds} alternating rounds:",
            "",
            "| requests | output tok/s |",
            "| --- | --- |",
            f"| base model | {base:.0f} |",
            f"| with the adapter | {with_adapter:.0f} |",
            "",
            f"adapter / base: {with_adapter / base:.2f}x",
        ]
        await client.close()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_output_argument(parser, "training.md")
    args = parser.parse_args()
    write_report(args.output, asyncio.run(run(args)), "bench_lora")


if __name__ == "__main__":
    main()
