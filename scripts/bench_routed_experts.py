"""What routed experts (R3) cost (issue 79, item 4): bytes per generated token on the wire
against vLLM's own servers' base64 ``.npy`` of the same array, for real MoE shapes, ordered and
as sets; and the trainer's batched generation (``generate_batch``: GenerateBatch, unpacked into
numpy arrays) with experts carried against without, rounds interleaved on one server.

The server's source is vLLM's ``RequestOutput`` as vLLM fills it on a GPU
(``testbed.routed_experts_source``: this CPU build cannot capture them), arrays of
Qwen3-30B-A3B's shape (48 layers, 8 of 128 experts) on the embedded model's tokens: a real MoE
generates far fewer tokens a second than the embedded model, so the cost per token of carrying
them is a larger share here than it would be there.

Run: .venv/bin/python -m scripts.bench_routed_experts [--rounds 3] [--output docs/weights.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

from scripts.bench_common import add_output_argument, median_range, write_report
from scripts.rollout_clients import prompt_for
from servers.fleet import local
from skyrl_grpc import routed_experts
from skyrl_grpc.v1 import generation_pb2
from trainer_client import InferenceClient

# name, MoE layers, experts per token, experts
SHAPES = [
    ("Qwen3-30B-A3B", 48, 8, 128),
    ("gpt-oss-120b", 36, 4, 128),
    ("DeepSeek-V3", 58, 8, 256),
    ("Kimi K2", 60, 8, 384),
    ("embedded MoE", 2, 2, 4),
]
PROMPT, GENERATED = 256, 1024  # a sample: its rows are the prompt's and the output's but one
SAMPLES, TOKENS = 64, 128  # the batched generation's batch


def wire_bytes(shape: tuple[int, int, int], rows: int) -> dict[str, float]:
    """Bytes on the wire for one sample's routing, ours (ordered, as sets) and vLLM's."""
    from vllm.utils.serial_utils import numpy2base64

    layers, per_token, experts = shape
    rng = np.random.default_rng(1)
    array = np.argsort(rng.random((rows, layers, experts)), axis=2)[:, :, :per_token]
    array = array.astype(np.uint8 if experts <= 256 else np.uint16)  # vLLM's capture's dtype
    figures = {"vllm": float(len(numpy2base64(array))), "narrowest": float(array.nbytes)}
    for name, as_sets in (("ordered", False), ("sets", True)):
        message = generation_pb2.RoutedExperts()
        message.CopyFrom(routed_experts.pack(array, as_sets=as_sets))
        figures[name] = float(len(message.SerializeToString()))
        back = routed_experts.unpack(message)
        assert np.array_equal(back, np.sort(array, axis=2) if as_sets else array)
    # Streamed, each message carries its steps' rows in a message of its own: the prompt's
    # on the first, then a step's (a message a step) or 16 steps' (the client's default
    # stream_interval) on each after it.
    for name, per_message in (("steps", 1), ("steps16", 16)):
        parts = [array[:PROMPT]] + [
            array[start : start + per_message] for start in range(PROMPT, rows, per_message)
        ]
        figures[name] = float(
            sum(len(routed_experts.pack(part).SerializeToString()) for part in parts)
        )
    return figures


# The batched generation's contenders: sampling settings beyond greedy decoding.
CONTENDERS = {
    "without experts": {},
    "with experts": {"return_routed_experts": True},
    "with experts as sets": {"return_routed_experts": True, "routed_experts_as_sets": True},
}


def run_batch(client: InferenceClient, asked: dict[str, bool]) -> Any:
    experts = bool(asked)

    async def run(batch: int) -> int:
        results = await client.generate_batch(
            [prompt_for(s, batch) for s in range(SAMPLES)],
            {"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True, **asked},
        )
        for result in results:  # each sample's array, its rows the prompt's and outputs' but one
            rows = len(result.prompt_token_ids) + len(result.token_ids) - 1
            if experts and (result.routed_experts is None or len(result.routed_experts) != rows):
                raise RuntimeError(f"a sample came back without its {rows} rows of experts")
        return sum(len(r.token_ids) for r in results)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    add_output_argument(parser, "weights.md")
    args = parser.parse_args()
    rows = PROMPT + GENERATED - 1
    lines = [
        f"Routed experts on the wire for one sample of {PROMPT} prompt and {GENERATED} generated "
        f"tokens ({rows} rows), random distinct ids per layer, bytes per generated token "
        "(`python -m scripts.bench_routed_experts`):",
        "",
        "| model's routing (layers, top-k of experts) | vLLM's base64 `.npy` | narrowest integers "
        "| ordered here (x vLLM) | as sets here (x vLLM) | streamed, a message a step (x ordered)"
        " | streamed, 16 steps a message (x ordered) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, layers, per_token, experts in SHAPES:
        f = wire_bytes((layers, per_token, experts), rows)
        lines.append(
            f"| {name} ({layers}, {per_token} of {experts}) | {f['vllm'] / GENERATED:.0f} | "
            f"{f['narrowest'] / GENERATED:.0f} | {f['ordered'] / GENERATED:.0f} "
            f"({f['ordered'] / f['vllm']:.2f}) | {f['sets'] / GENERATED:.0f} "
            f"({f['sets'] / f['vllm']:.2f}) | {f['steps'] / GENERATED:.0f} "
            f"({f['steps'] / f['ordered']:.2f}) | {f['steps16'] / GENERATED:.0f} "
            f"({f['steps16'] / f['ordered']:.2f}) |"
        )
        print(lines[-1], flush=True)

    local.ENGINE_MODULE = "testbed.routed_experts_source"  # the server with the GPU's source
    tok_s: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    with local.LocalFleet(1, ["--enable-return-routed-experts"]) as fleet:
        server = fleet.addresses.servers[0]

        async def rounds() -> None:
            client = InferenceClient(server, [server])
            runs = {name: run_batch(client, asked) for name, asked in CONTENDERS.items()}
            for run in runs.values():  # first generations are slow
                await run(0)
            for round_index in range(args.rounds):
                names = list(runs)
                order = names if round_index % 2 == 0 else names[::-1]
                for name in order:
                    started = time.perf_counter()
                    tokens = await runs[name](round_index + 1)
                    tok_s[name].append(tokens / (time.perf_counter() - started))
                    print(f"round {round_index + 1} {name}: {tok_s[name][-1]:.0f} tok/s")
            await client.close()

        asyncio.run(rounds())
    lines += [
        "",
        f"The trainer's batched generation (`generate_batch`, {SAMPLES} prompts of 16 tokens, "
        f"{TOKENS} greedy tokens each, the embedded model on one server whose vLLM hands over "
        "Qwen3-30B-A3B-shaped routing as on a GPU, every array checked for its rows; medians of "
        f"{args.rounds} interleaved rounds, ranges in brackets):",
        "",
        "| contender | tokens/s | x without experts |",
        "| --- | --- | --- |",
    ]
    baseline = tok_s["without experts"]
    for name, figures in tok_s.items():
        ratio = statistics.median(a / b for a, b in zip(figures, baseline, strict=True))
        lines.append(f"| {name} | {median_range(figures, 0)} | {ratio:.2f} |")
    write_report(args.output, lines, "routed-experts")


if __name__ == "__main__":
    main()
