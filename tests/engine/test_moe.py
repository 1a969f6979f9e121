"""The embedded mixture of experts (``serve --model tiny-moe``: Mixtral's architecture, 4
experts a layer, top-2, built here like the tiny Llama): served by vLLM from its fused expert
tensors, and weight updates that land exactly there. What a fresh server started from the
pushed checkpoint generates (greedy tokens and their logprobs, bit for bit) is what the updated
server generates; a tensor of the wrong shape is refused before anything is staged."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from skyrl_grpc.tiny_model import embedded_model_path
from tests.helpers.server_process import ServerProcess
from trainer_client import InferenceClient, WeightUpdateError

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPTS = [[1, 45, 722, 84], [1, 300, 301, 302], [1, 7, 900, 12, 1500]]
GREEDY = {"temperature": 0.0, "max_tokens": 24, "logprobs": 0, "ignore_eos": True}


def moe_dir() -> Path:
    path = embedded_model_path("tiny-moe")
    assert path is not None
    return path


def started(*args: str) -> ServerProcess:
    server = ServerProcess(*args)
    try:
        server.until("ready")
    except BaseException:
        server.kill()
        raise
    return server


@pytest.fixture(scope="module")
def moe_server() -> Iterator[ServerProcess]:
    server = started("--model", "tiny-moe")
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
async def client(moe_server: ServerProcess) -> AsyncIterator[InferenceClient]:
    client = InferenceClient(moe_server.address, [moe_server.address], direct=False)
    try:
        yield client
    finally:
        await client.close()


async def answers(client: InferenceClient) -> list[tuple[list[int], list[float]]]:
    results = [await client.generate(p, GREEDY) for p in PROMPTS]
    return [(list(r.token_ids), list(r.logprobs or [])) for r in results]


def checkpoint(weights: dict[str, torch.Tensor], into: Path) -> Path:
    """``weights`` as a model directory (the embedded MoE's config and tokenizer)."""
    shutil.copytree(moe_dir(), into, dirs_exist_ok=True)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(into / "model.safetensors"))
    return into


def is_expert(name: str) -> bool:
    return ".block_sparse_moe.experts." in name


async def test_the_embedded_mixture_of_experts_is_served_by_name(
    client: InferenceClient,
) -> None:
    config = (moe_dir() / "config.json").read_text()
    assert '"MixtralForCausalLM"' in config and '"num_local_experts": 4' in config
    (info,) = (await client.server_info()).values()
    assert info.served_model_name == "skyrl-tiny-moe"
    for tokens, logprobs in await answers(client):
        assert len(tokens) == GREEDY["max_tokens"] and len(logprobs) == len(tokens)


async def test_full_and_delta_updates_into_the_fused_experts_equal_a_fresh_server(
    client: InferenceClient, tmp_path: Path
) -> None:
    original = load_file(str(moe_dir() / "model.safetensors"))
    before = await answers(client)
    version = max((await client.weight_versions()).values()) + 1
    # Every expert changed (each layer's fused w13 and w2 in vLLM), the rest as they were.
    full = {n: t * 1.5 if is_expert(n) else t for n, t in original.items()}
    await client.update_weights(full.items(), version, delta=False)
    after_full = await answers(client)
    assert [t for t, _ in after_full] != [t for t, _ in before], "the update changed nothing"
    # Then one expert of each layer only: a delta that patches part of the fused tensors.
    patched = {n: t + 0.02 if ".experts.1." in n else t for n, t in full.items()}
    await client.update_weights(patched.items(), version + 1, delta=True)
    after_delta = await answers(client)
    assert after_delta != after_full
    (served,) = (await client.weight_checksums()).values()
    # In float32, as the embedded model is served (a model directory's "auto" dtype is
    # bfloat16 on this CPU).
    fresh = started("--model", str(checkpoint(patched, tmp_path / "pushed")), "--dtype", "float32")
    try:
        other = InferenceClient(fresh.address, [fresh.address], direct=False)
        try:
            assert await answers(other) == after_delta  # tokens and logprobs, bit for bit
            (theirs,) = (await other.weight_checksums()).values()
        finally:
            await other.close()
    finally:
        await asyncio.to_thread(fresh.kill)
    assert served == theirs


async def test_an_expert_of_the_wrong_shape_is_refused_with_nothing_staged(
    client: InferenceClient,
) -> None:
    original = load_file(str(moe_dir() / "model.safetensors"))
    versions = dict(await client.weight_versions())
    before = await answers(client)
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    wrong: dict[str, Any] = {**original, name: original[name].t().contiguous()}
    with pytest.raises(WeightUpdateError) as refused:
        await client.update_weights(wrong.items(), max(versions.values()) + 1, delta=False)
    assert name in str(refused.value) and "shape" in str(refused.value), refused.value
    assert dict(await client.weight_versions()) == versions
    assert await answers(client) == before
