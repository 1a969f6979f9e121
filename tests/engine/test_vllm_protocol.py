"""vLLM's own gRPC protocol (``vllm.grpc.engine.VllmEngine``, what ``vllm serve --grpc`` serves)
on this stack's engine servers, and SMG, the Rust gateway (``smg launch``), in front of two of
them: the same engine as the DataPlane (the same greedy tokens), bad input refused with a
status, completions and chat through SMG streamed and not, a session kept on one server, and
the fleet's weight updates reaching what SMG serves."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from servers.engine.service.vllm_protocol import VLLM_ENGINE
from skyrl_grpc.tiny_model import TINY_MODEL_NAME as MODEL
from tests.conftest import REFERENCE_PROMPTS
from tests.helpers.smg import smg_over
from tests.helpers.weights import GREEDY, MAX_TOKENS, next_version, perturbed
from trainer_client import InferenceClient

pytestmark = [pytest.mark.engine]
SESSION_HEADER = "x-session-id"


def greedy_request(prompt: list[int], stream: bool) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id=f"vllm-protocol-{os.urandom(4).hex()}",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        stream=stream,
        sampling_params=vllm_engine_pb2.SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
        ),
    )


async def vllm_engine_tokens(address: str, prompt: list[int], stream: bool) -> list[int]:
    """The greedy tokens of ``prompt`` over vLLM's protocol: the complete message's, or every
    streamed chunk's in order."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        tokens: list[int] = []
        async for response in stub.Generate(greedy_request(prompt, stream)):
            if response.HasField("chunk"):
                tokens += response.chunk.token_ids
            elif not stream:
                tokens += response.complete.output_ids
        return tokens


async def test_vllm_engine_generates_what_the_data_plane_does(engine_server: Any) -> None:
    """The same engine behind both protocols: greedy tokens equal, streamed and whole; health
    and reflection name the service."""
    address = engine_server.address
    ours = InferenceClient(address)
    try:
        for prompt in REFERENCE_PROMPTS:
            expected = (await ours.generate(prompt, GREEDY)).token_ids
            assert await vllm_engine_tokens(address, prompt, stream=False) == expected
            assert await vllm_engine_tokens(address, prompt, stream=True) == expected
    finally:
        await ours.close()
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=VLLM_ENGINE))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        info = await stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
        assert info.max_context_length == engine_server.state.parts().engine.max_model_len


async def test_a_bad_vllm_engine_request_is_refused_and_the_server_keeps_serving(
    engine_server: Any,
) -> None:
    address = engine_server.address
    beyond = engine_server.state.parts().engine.vocab_size + 5
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(greedy_request([1, beyond], stream=True)):
                pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(beyond) in (refused.value.details() or "")
    assert len(await vllm_engine_tokens(address, REFERENCE_PROMPTS[0], stream=True)) == MAX_TOKENS


@pytest.fixture(scope="module")
async def smg(engine_server: Any, second_engine_server: Any) -> AsyncIterator[str]:
    """SMG launched over both shared engine servers, as ``up --gateway smg`` launches it
    (sessions kept by ``x-session-id``); its HTTP address once it lists both."""
    async with smg_over([engine_server.address, second_engine_server.address]) as gateway:
        yield gateway.base


def completion(base: str, prompt: str, session: str = "", **extra: Any) -> dict[str, Any]:
    headers = {SESSION_HEADER: session} if session else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    answer = httpx.post(
        f"{base}/v1/completions", json={**body, **extra}, headers=headers, timeout=60
    )
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


async def test_smg_serves_completions_and_chat_over_the_fleet_streamed_and_not(
    smg: str,
) -> None:
    from openai import AsyncOpenAI

    sdk = AsyncOpenAI(base_url=f"{smg}/v1", api_key="unused")
    try:
        whole = await sdk.completions.create(
            model=MODEL, prompt="hello world", max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert whole.usage is not None and whole.usage.completion_tokens == MAX_TOKENS
        streamed = await sdk.completions.create(
            model=MODEL, prompt="hello world", max_tokens=MAX_TOKENS, temperature=0.0, stream=True
        )
        text = "".join([c.choices[0].text async for c in streamed if c.choices])
        assert text == whole.choices[0].text and text
        messages: Any = [{"role": "user", "content": "hi"}]
        chat = await sdk.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content
        deltas = await sdk.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
        )
        pieces = [c.choices[0].delta.content or "" async for c in deltas if c.choices]
        assert "".join(pieces) == chat.choices[0].message.content
    finally:
        await sdk.close()


def generate_calls(servers: list[Any]) -> list[int]:
    return [s.vllm_engine.generate_calls for s in servers]


async def test_smg_keeps_a_session_on_one_server(
    smg: str, engine_server: Any, second_engine_server: Any
) -> None:
    servers = [engine_server, second_engine_server]
    for session in ("session-a", "session-b", "session-c"):
        before = generate_calls(servers)
        for turn in range(4):
            await asyncio.to_thread(completion, smg, f"turn {turn} of {session}", session)
        moved = [after - b for after, b in zip(generate_calls(servers), before, strict=True)]
        assert sorted(moved) == [0, 4], f"{session}'s turns went to the servers as {moved}"


async def test_smg_serves_the_fleets_weights_after_an_update(
    smg: str, engine_server: Any, second_engine_server: Any, tiny_model_dir: Path
) -> None:
    """A fleet-wide update by the trainer client changes what SMG serves on every server; the
    weights pushed back restore it."""
    servers = [engine_server.address, second_engine_server.address]
    sessions = ("update-a", "update-b", "update-c", "update-d")  # lands on both servers
    prompt = "the weights serve"

    def texts() -> set[str]:
        return {completion(smg, prompt, s)["choices"][0]["text"] for s in sessions}

    before = await asyncio.to_thread(texts)
    assert len(before) == 1
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    client = InferenceClient(servers[0], servers, direct=False)
    try:
        version = await next_version(client)
        await client.update_weights(perturbed(original, seed=80).items(), version, delta=False)
        updated = await asyncio.to_thread(texts)
        assert len(updated) == 1 and updated != before
        await client.update_weights(original.items(), version + 1, delta=False)
        assert await asyncio.to_thread(texts) == before
    finally:
        await client.close()
