"""Routed experts step by step, end to end: a server whose vLLM hands over each step's routing
as a GPU runner does (``testbed.routed_experts_source``; this CPU build captures none), behind
a real router. Every message carries the rows of the tokens its steps fed through the model,
aligned token by token on each path (a call per stream, the client's and the router's
multiplexed calls, a batch, n samples, a LoRA adapter's requests), and a sample continued after
an abort gets each token's row once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from servers.fleet import local
from tests.helpers.adapters import make_adapter
from tests.helpers.waits import ENGINE_START_SECONDS, running_on_engines, until
from trainer_client import InferenceClient

pytestmark = pytest.mark.engine
LAYERS, PER_TOKEN, EXPERTS = 3, 2, 8
PROMPT = [1, 17, 23, 99, 5, 61]
START = 2  # routed_experts_prompt_start: the prompt's rows from here
TOKENS = 24
SAMPLING: dict[str, Any] = {
    "temperature": 0.0,
    "ignore_eos": True,
    "max_tokens": TOKENS,
    "return_routed_experts": True,
    "routed_experts_prompt_start": START,
}


@pytest.fixture(scope="module")
def fleet() -> Iterator[local.LocalFleet]:
    default = local.ENGINE_MODULE
    local.ENGINE_MODULE = "testbed.routed_experts_source"
    env = {"ROUTED_EXPERTS_SHAPE": f"{LAYERS},{PER_TOKEN},{EXPERTS}"}
    flags = ["--enable-return-routed-experts", "--enable-lora", "--max-lora-rank", "8"]
    started = local.LocalFleet(1, flags, env=env, start_timeout=ENGINE_START_SECONDS)
    try:
        started.__enter__()
    finally:
        local.ENGINE_MODULE = default
    try:
        yield started
    finally:
        started.__exit__(None, None, None)


def aligned(chunks: list[Any]) -> list[int]:
    """Each message's rows, checked against its tokens: after every message, the rows so far
    are the prompt's from START and then one per token so far but the last."""
    rows, tokens, per_message = 0, 0, []
    for chunk in chunks:
        tokens += len(chunk.token_ids)
        rows += chunk.routed_experts.tokens
        per_message.append(chunk.routed_experts.tokens)
        assert rows == len(PROMPT) - START + tokens - 1, (rows, tokens)
        if chunk.HasField("routed_experts"):
            assert (chunk.routed_experts.layers, chunk.routed_experts.per_token) == (
                LAYERS,
                PER_TOKEN,
            )
    return per_message


@pytest.mark.parametrize("path", ["direct, multiplexed", "direct, a call each", "router"])
async def test_each_message_carries_the_rows_of_its_steps(
    fleet: local.LocalFleet, path: str
) -> None:
    servers = list(fleet.addresses.servers)
    client = InferenceClient(
        fleet.addresses.router,
        servers,
        direct=path != "router",
        multiplex=path == "direct, multiplexed",
    )
    try:
        chunks = [c async for c in client.stream(PROMPT, SAMPLING, stream_interval=0)]
        per_message = aligned(chunks)
        assert sum(len(c.token_ids) for c in chunks) == TOKENS
        # Step by step, not whole at the end: most messages carry rows of their own.
        assert sum(1 for rows in per_message if rows) > len(per_message) // 2, per_message
        whole = await client.generate(PROMPT, SAMPLING)
        assert whole.routed_experts.shape == (len(PROMPT) - START + TOKENS - 1, LAYERS, PER_TOKEN)
        assert int(whole.routed_experts.max()) < EXPERTS
    finally:
        await client.close()


async def test_a_batch_and_n_samples_each_get_their_rows(fleet: local.LocalFleet) -> None:
    server = fleet.addresses.servers[0]
    client = InferenceClient(fleet.addresses.router, [server])
    try:
        # n samples of one request (vLLM's child requests): each sample's messages aligned.
        sampled = {**SAMPLING, "temperature": 1.0}
        chunks = [c async for c in client.stream(PROMPT, sampled, n=3, stream_interval=0)]
        for index in range(3):
            per_message = aligned([c for c in chunks if c.sample_index == index])
            assert sum(1 for rows in per_message if rows) > len(per_message) // 2, per_message
        prompts = [PROMPT, [1, 2, 3, 4], [1, 9, 8, 7, 6, 5, 4]]
        results = await client.generate_batch(prompts, SAMPLING)
        for prompt, result in zip(prompts, results, strict=True):
            assert len(result.token_ids) == TOKENS
            assert result.routed_experts.shape[0] == len(prompt) - START + TOKENS - 1
        samples = await client.sample(PROMPT, {**SAMPLING, "temperature": 1.0}, n=3)
        for sample in samples:
            assert sample.routed_experts.shape[0] == len(PROMPT) - START + TOKENS - 1
    finally:
        await client.close()


async def test_a_lora_requests_messages_carry_their_rows(
    fleet: local.LocalFleet, tiny_model_dir: Path
) -> None:
    server = fleet.addresses.servers[0]
    client = InferenceClient(fleet.addresses.router, [server])
    tensors, config = make_adapter(tiny_model_dir, seed=3)
    try:
        await client.load_lora("routed", tensors=tensors, config=config)
        chunks = [
            c async for c in client.stream(PROMPT, SAMPLING, lora="routed", stream_interval=0)
        ]
        assert {c.lora_version for c in chunks} == {1}  # generated with the adapter
        per_message = aligned(chunks)
        assert sum(1 for rows in per_message if rows) > len(per_message) // 2, per_message
    finally:
        await client.unload_lora("routed")
        await client.close()


async def test_a_sample_continued_after_an_abort_gets_each_tokens_row_once(
    fleet: local.LocalFleet,
) -> None:
    """The pause aborts the generation mid-way; the client resubmits the prompt plus the
    tokens so far, asking for the routing after the rows it holds: the earlier tokens' rows
    are those of the steps that made them, and none comes twice."""
    server = fleet.addresses.servers[0]
    client = InferenceClient(fleet.addresses.router, [server])
    long = {**SAMPLING, "max_tokens": 400}
    try:
        running = asyncio.ensure_future(client.generate(PROMPT, long))
        await running_on_engines(client, 1, running)
        await client.pause("abort")

        async def resubmitted() -> bool:
            assert not running.done(), "the generation ended during the pause"
            loads = await client.server_loads()
            return sum(load.waiting_requests for load in loads.values()) > 0

        await until(resubmitted, what="the aborted generation queued for resume")
        await client.resume()
        result = await asyncio.wait_for(running, 120)
        assert result.abort_retries >= 1, "the pause aborted nothing"
        assert len(result.token_ids) == 400
        assert result.routed_experts.shape == (len(PROMPT) - START + 400 - 1, LAYERS, PER_TOKEN)
    finally:
        await client.resume()
        await client.close()
