"""What constrained generation costs the requests beside it (issue: the agent surface).

One engine server and a router, started as processes on a model built on the spot; streams of
generations through the trainer client, in closed loops, for a fixed time per phase:

1. ``constrained alone``: S streams constrained by a JSON schema (sampled at temperature 1.0);
   their mean output length L is measured.
2. ``plain alone``: S unconstrained streams.
3. ``plain + plain``: the same S streams while S more unconstrained streams of L tokens each
   share the engine.
4. ``plain + constrained``: the same S streams while the S constrained streams share it.

The target compares 4 with 3 -- the same engine load (as many requests, as many tokens each),
half of it constrained or not -- so it measures what the constraint costs its neighbours, not
what sharing an engine costs (any co-load slows a saturated engine) nor the request churn of
short answers. 4 against 2 is printed beside it. The cost per constrained token compares the
co-load's own throughput in 4 and 3.

Run: .venv/bin/python -m scripts.bench_constrained [--streams 8] [--seconds 15]
     [--model tiny|0.1b] [--output docs/serving.md]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from scripts.bench_common import add_output_argument, write_report
from servers.fleet.local import LocalFleet
from skyrl_grpc.tiny_model import TinyModelSpec, ensure_tiny_model
from trainer_client import InferenceClient

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "reason": {"type": "string", "maxLength": 40},
        "score": {"type": "integer"},
    },
    "required": ["answer", "reason", "score"],
    "additionalProperties": False,
}
MODELS = {
    "tiny": TinyModelSpec(),
    # ~0.1B parameters: matrices large enough that the model, not Python, sets the pace.
    "0.1b": TinyModelSpec(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
}


async def closed_loop(
    client: InferenceClient, sampling: dict[str, Any], streams: int, stop: asyncio.Event
) -> tuple[int, int]:
    """Generations back to back on ``streams`` streams until ``stop``; (tokens, requests)."""
    tokens = requests = 0

    async def stream(index: int) -> None:
        nonlocal tokens, requests
        rng = random.Random(index)
        while not stop.is_set():
            prompt = [1, *(rng.randrange(10, 2000) for _ in range(16))]
            result = await client.generate(prompt, sampling)
            tokens += len(result.token_ids)
            requests += 1

    await asyncio.gather(*(stream(i) for i in range(streams)))
    return tokens, requests


async def phase(
    client: InferenceClient, loads: list[dict[str, Any]], streams: int, seconds: float
) -> list[tuple[float, float]]:
    """Runs every load (S streams each) together for ``seconds``; per load, tokens/s and mean
    tokens per request."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(closed_loop(client, s, streams, stop)) for s in loads]
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    stop.set()
    counts = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started  # includes the requests in flight at the end
    return [(tokens / elapsed, tokens / max(requests, 1)) for tokens, requests in counts]


async def measure(address: str, streams: int, seconds: float, max_tokens: int) -> list[str]:
    client = InferenceClient(address)
    plain = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    constrained = {
        "temperature": 1.0,
        "max_tokens": max_tokens,
        "structured_output": {"json_schema": SCHEMA},
    }
    await phase(client, [plain, constrained], streams, 3)  # warm up (grammar compile cache too)
    ((constrained_alone, length),) = await phase(client, [constrained], streams, seconds)
    # The plain co-load: as many tokens per request as the constrained answers have.
    short = {**plain, "max_tokens": max(1, round(length))}
    ((alone, _),) = await phase(client, [plain], streams, seconds)
    (with_plain, _), (co_plain, _) = await phase(client, [plain, short], streams, seconds)
    (with_constrained, _), (co_constrained, _) = await phase(
        client, [plain, constrained], streams, seconds
    )
    await client.close()
    cost_us = (1 / co_constrained - 1 / co_plain) * 1e6
    return [
        "| phase | plain streams' tokens/s | co-load's tokens/s |",
        "| --- | --- | --- |",
        f"| constrained alone ({length:.1f} tokens per answer) | | {constrained_alone:.0f} |",
        f"| plain alone | {alone:.0f} | |",
        f"| plain + plain of {round(length)} tokens | {with_plain:.0f} | {co_plain:.0f} |",
        f"| plain + constrained | {with_constrained:.0f} | {co_constrained:.0f} |",
        "",
        f"- plain throughput beside constrained / beside plain (target >= 0.9x): "
        f"**{with_constrained / with_plain:.2f}x**",
        f"- plain throughput beside constrained / alone: {with_constrained / alone:.2f}x",
        f"- cost per constrained token: {cost_us:+.0f} us "
        f"({1e6 / co_constrained:.0f} us against {1e6 / co_plain:.0f} us per token of the "
        f"plain co-load, {streams} + {streams} streams)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    add_output_argument(parser, "serving.md")
    args = parser.parse_args()
    model = ensure_tiny_model(spec=MODELS[args.model])
    engine_args = ["--model", str(model)]
    with LocalFleet(1, engine_args=engine_args) as fleet:
        lines = asyncio.run(
            measure(fleet.addresses.router, args.streams, args.seconds, args.max_tokens)
        )
    title = (
        f"#### {args.model} model, 1 server, {args.streams}+{args.streams} streams, "
        f"{args.max_tokens} tokens per request, {args.seconds:g} s per phase"
    )
    write_report(args.output, [title, "", *lines], f"bench_constrained {args.model}")


if __name__ == "__main__":
    main()
