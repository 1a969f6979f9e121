"""Weights for tests: perturbed copies of the tiny model and greedy outputs per server."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from tests.conftest import REFERENCE_PROMPTS
from tests.helpers.waits import running_on_engines
from trainer_client import InferenceClient

MAX_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def perturbed(original: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The weights plus seeded noise: different greedy outputs, still finite."""
    generator = torch.Generator().manual_seed(seed)
    return {
        n: t + 0.05 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
        for n, t in original.items()
    }


async def greedy_per_server(servers: list[str], lora: str = "") -> dict[str, list[list[int]]]:
    """Greedy outputs of the reference prompts on each server, asked directly (with the LoRA
    adapter ``lora``; "": the base model)."""
    result = {}
    for address in servers:
        direct = InferenceClient(address)
        result[address] = [
            (await direct.generate(p, GREEDY, lora=lora)).token_ids for p in REFERENCE_PROMPTS
        ]
        await direct.close()
    return result


async def next_version(client: InferenceClient) -> int:
    """One more than the newest version any of the client's servers serves."""
    return max((await client.weight_versions()).values()) + 1


async def on_one_version(client: InferenceClient, weights: dict[str, torch.Tensor]) -> None:
    """Puts the client's servers on one version (pushing ``weights`` if they differ): placement
    keeps calls off a server behind the others, so a test of spreading needs none behind."""
    if not (await client.weight_versions()).consistent:
        await client.update_weights(weights.items(), await next_version(client), delta=False)


# A prompt prefix of several full prefix-cache blocks (128 tokens each on CPU).
SHARED_PREFIX = [1, *range(100, 400)]


async def update_while_a_prefix_is_held(
    client: InferenceClient, weights: dict[str, torch.Tensor], prefix: list[int] = SHARED_PREFIX
) -> asyncio.Future[Any]:
    """Pushes ``weights`` while requests sharing ``prefix`` hold its cache blocks, paused in
    KEEP mode (so the prefix-cache reset after the update cannot free them), then resumes;
    returns those requests' batch, to await. Requests after it must not reuse the blocks
    computed under the weights it replaced."""
    holding = asyncio.ensure_future(
        client.generate_batch(
            [[*prefix, 900 + i] for i in range(4)],
            {"temperature": 0.0, "max_tokens": 150, "ignore_eos": True},
        )
    )
    await running_on_engines(client, 4, holding)
    await client.pause("keep")
    await client.update_weights(weights.items(), transport="grpc")
    await client.resume()
    return holding
