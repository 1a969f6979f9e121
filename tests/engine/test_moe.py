"""The embedded mixture of experts (``serve --model tiny-moe``: Mixtral's architecture, 4
experts a layer, top-2, built here like the tiny Llama): served by vLLM from its fused expert
tensors, and weight updates that land exactly there, direct, relayed and read by a server
catching up. What a fresh server started from the pushed checkpoint generates (greedy tokens
and their logprobs, bit for bit) is what the updated servers generate; a tensor of the wrong
shape is refused before anything is staged. LoRA on it needs vLLM's Triton kernels, which
vLLM's CPU build lacks: refused at start, saying so."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from skyrl_grpc.tensor_bytes import sha256_of
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


async def test_relayed_updates_and_a_caught_up_server_land_exactly_in_the_fused_experts(
    tmp_path: Path,
) -> None:
    """Two MoE servers updated in-band through the relay (one tree each), full then a delta
    patching one expert a layer; then a third started to read the fleet's weights from them
    (catch-up). Every server's weights are the pushed tensors (their SHA-256) and they all
    generate what a fresh server started from the pushed checkpoint does, bit for bit."""
    original = load_file(str(moe_dir() / "model.safetensors"))
    full = {n: t * 1.25 if is_expert(n) else t for n, t in original.items()}
    patched = {n: t - 0.03 if ".experts.3." in n else t for n, t in full.items()}
    pushed = {n: sha256_of(t) for n, t in patched.items()}
    servers = [started("--model", "tiny-moe") for _ in range(2)]
    late: ServerProcess | None = None
    fresh: ServerProcess | None = None
    try:
        addresses = [s.address for s in servers]
        client = InferenceClient(addresses[0], addresses, direct=False)
        try:
            version = max((await client.weight_versions()).values()) + 1
            first = await client.update_weights(full.items(), version, delta=False)
            second = await client.update_weights(patched.items(), version + 1, delta=True)
            assert first.relayed and second.relayed
            assert all(dict(sums) == pushed for sums in (await client.weight_checksums()).values())
        finally:
            await client.close()
        late = started("--model", "tiny-moe", "--catch-up-from", ",".join(addresses))
        fresh = started(
            "--model", str(checkpoint(patched, tmp_path / "pushed")), "--dtype", "float32"
        )
        served = []
        for server in (*servers, late, fresh):
            one = InferenceClient(server.address, [server.address], direct=False)
            try:
                served.append((await answers(one), await one.weight_checksums()))
            finally:
                await one.close()
        reference = served[-1][0]
        names = ["relayed to first", "relayed to second", "caught up"]
        for (outputs, sums), name in zip(served, names, strict=False):
            assert outputs == reference, name  # tokens and logprobs, bit for bit
            assert dict(next(iter(sums.values()))) == pushed, name
    finally:
        for process in (*servers, late, fresh):
            if process is not None:
                await asyncio.to_thread(process.kill)


def test_lora_on_the_mixture_of_experts_is_refused_at_start_with_vllms_reason_here() -> None:
    """vLLM serves LoRA on a mixture-of-experts model through Triton kernels (its experts'
    LoRA layers are made with the attention's), which its CPU build does not have: a server
    started so fails at start, saying why and what to do, instead of on the first request."""
    server = ServerProcess("--model", "tiny-moe", "--enable-lora", "--max-lora-rank", "8")
    try:
        with pytest.raises(AssertionError, match="exited before 'ready'") as failed:
            server.until("ready")
    finally:
        server.kill()
    message = str(failed.value)
    assert "triton" in message.lower() and "mixture-of-experts" in message, message
    assert "--dtype float32" not in message  # not the hint for a dtype problem
