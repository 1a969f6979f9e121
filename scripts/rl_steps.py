"""One step of the RL loop the fleet benchmarks run (``bench_standby``, ``bench_elastic``):
session rollouts, then a delta weight update between a pause and a resume, tried again after
0.5 s when it fails, as a trainer would. What a step lost, tried again and met is tallied."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from trainer_client import GenerationResult, InferenceClient, PauseMode


@dataclass
class Tally:
    """Generations lost (a call that raised, or a sample cut short), updates tried again, and
    what went wrong, across steps."""

    lost: int = 0
    retries: int = 0
    events: list[str] = field(default_factory=list)


def start_rollout(
    client: InferenceClient, rng: random.Random, sessions: int, tokens: int, prefix: str
) -> asyncio.Future[list[GenerationResult]]:
    """``sessions`` session rollouts of ``tokens`` sampled tokens, under way."""
    prompts = [[1, *(rng.randrange(3, 2000) for _ in range(8))] for _ in range(sessions)]
    ids = [f"{prefix}-{i}" for i in range(sessions)]
    sampling = {"temperature": 1.0, "max_tokens": tokens, "ignore_eos": True}
    return asyncio.ensure_future(client.generate_batch(prompts, sampling, session_ids=ids))


async def finish_step(
    client: InferenceClient,
    rollout: asyncio.Future[list[GenerationResult]],
    weights: dict[str, Any],
    generator: Any,
    step: int,
    sessions: int,
    tokens: int,
    tally: Tally,
) -> None:
    """Waits for ``rollout`` (``sessions`` rollouts of ``tokens``), then pushes a small change
    of ``weights`` as version ``step + 1`` (pause, delta update, resume), until it commits."""
    import torch

    try:
        results = await rollout
        tally.lost += sum(1 for r in results if len(r.token_ids) != tokens)
    except Exception as error:  # every generation of the batch counts as lost
        tally.lost += sessions
        tally.events.append(f"step {step} generate: {error!r}"[:200])
    for tensor in weights.values():  # a small step: a delta update
        tensor.add_(1e-4 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
    while True:
        try:
            await client.pause(PauseMode.ABORT)
            await client.update_weights(weights.items(), step + 1)
            await client.resume()
            return
        except Exception as error:
            tally.retries += 1
            tally.events.append(f"step {step} update: {error!r}"[:200])
            await asyncio.sleep(0.5)
