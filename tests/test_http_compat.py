"""Compatibility of the OpenAI HTTP edge with vLLM's own OpenAI server: the same greedy
requests to both, on the same model, give the same token ids and finish reasons, in responses
that carry every key of vLLM's that the OpenAI SDK reads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai.types as oa
import openai.types.chat as oac
import pytest
from pydantic import BaseModel

from tests.helpers.vllm_http import vllm_http_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
async def vllm_http(tiny_model_dir: Path) -> AsyncIterator[str]:
    """vLLM's server, started in a thread: the in-process engine servers keep serving."""
    # With its token-in / token-out and render endpoints (off by default in vLLM's server).
    server = vllm_http_server(model=tiny_model_dir, extra_args=("--enable-scale-out",))
    base_url = await asyncio.to_thread(server.__enter__)
    yield base_url
    await asyncio.to_thread(server.__exit__, None, None, None)


def sdk_keys(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields)


def missing_keys(ours: Any, theirs: Any, shape: dict[str, Any]) -> list[str]:
    """Keys of ``theirs`` that the SDK reads (``shape``: key -> nested shape or a model) and
    ``ours`` lacks, recursively."""
    missing = []
    model = shape.get("__model__")
    read = sdk_keys(model) if model is not None else set(theirs)
    for key in read & set(theirs):
        if key not in ours:
            missing.append(key)
        elif key in shape and isinstance(theirs[key], list) and theirs[key] and ours[key]:
            missing += [
                f"{key}.{k}" for k in missing_keys(ours[key][0], theirs[key][0], shape[key])
            ]
        elif key in shape and isinstance(theirs[key], dict) and isinstance(ours[key], dict):
            missing += [f"{key}.{k}" for k in missing_keys(ours[key], theirs[key], shape[key])]
    return missing


COMPLETION = {
    "__model__": oa.Completion,
    "choices": {"__model__": oa.CompletionChoice},
    "usage": {"__model__": oa.CompletionUsage},
}
CHAT = {
    "__model__": oac.ChatCompletion,
    "choices": {
        "__model__": oac.chat_completion.Choice,
        "message": {"__model__": oac.ChatCompletionMessage},
    },
    "usage": {"__model__": oa.CompletionUsage},
}
CHUNK = {
    "__model__": oac.ChatCompletionChunk,
    "choices": {"__model__": oac.chat_completion_chunk.Choice},
}


async def streamed(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> list[dict[str, Any]]:
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


async def test_same_tokens_finish_reasons_and_sdk_keys_as_vllms_server(
    http_router: Any, vllm_http: str
) -> None:
    edge = f"http://127.0.0.1:{http_router.http_port}"
    prompts = [[1, 5, 9, 200], [1, 77, 78, 79, 80, 81], list(range(3, 40))]
    async with httpx.AsyncClient(timeout=120) as client:
        for prompt in prompts:
            for stop in (None, 2):  # run to the length limit, or to an early stop token
                body: dict[str, Any] = {
                    "model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0,
                    "return_token_ids": True,
                }  # fmt: skip
                if stop is not None:
                    body["stop_token_ids"] = [int(t) for t in range(2, 400, 7)]
                ours = (
                    await client.post(f"{edge}/v1/completions", json={**body, "model": ""})
                ).json()
                theirs = (await client.post(f"{vllm_http}/v1/completions", json=body)).json()
                for a, b in zip(ours["choices"], theirs["choices"], strict=True):
                    assert a["token_ids"] == b["token_ids"], (prompt, a, b)
                    assert a["finish_reason"] == b["finish_reason"]
                    assert a["text"] == b["text"]
                assert missing_keys(ours, theirs, COMPLETION) == []
        messages = [{"role": "user", "content": "Say something."}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0.0,
                "return_token_ids": True}  # fmt: skip
        ours = (await client.post(f"{edge}/v1/chat/completions", json={**body, "model": ""})).json()
        theirs = (await client.post(f"{vllm_http}/v1/chat/completions", json=body)).json()
        assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]
        assert ours["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"]
        assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
        assert (
            ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
        )
        assert missing_keys(ours, theirs, CHAT) == []
        ours_events = await streamed(client, f"{edge}/v1/chat/completions", {**body, "model": ""})
        theirs_events = await streamed(client, f"{vllm_http}/v1/chat/completions", body)
        tokens = [[t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
                  for events in (ours_events, theirs_events)]  # fmt: skip
        assert tokens[0] == tokens[1] == theirs["choices"][0]["token_ids"]
        assert missing_keys(ours_events[0], theirs_events[0], CHUNK) == []
        assert missing_keys(ours_events[-1], theirs_events[-1], CHUNK) == []


async def test_token_in_token_out_and_render_match_vllms_server(
    http_router: Any, vllm_http: str
) -> None:
    """``/inference/v1/generate`` and ``/v1/chat/completions/render`` as vLLM serves them (what
    SkyRL's RemoteInferenceClient posts and reads): the same token ids, logprobs and finish
    reasons for greedy requests, the same rendered prompt, plus each token's weight version."""
    edge = f"http://127.0.0.1:{http_router.http_port}"
    async with httpx.AsyncClient(timeout=120) as client:
        for prompt, extra in (([1, 5, 9, 200], {}), (list(range(3, 40)), {"stop_token_ids": [7]})):
            body = {
                "token_ids": prompt, "model": "tiny",
                "sampling_params": {"temperature": 0.0, "max_tokens": 12, "logprobs": 2, **extra},
            }  # fmt: skip
            ours = await client.post(f"{edge}/inference/v1/generate", json={**body, "model": ""})
            theirs = await client.post(f"{vllm_http}/inference/v1/generate", json=body)
            assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
            a, b = ours.json()["choices"][0], theirs.json()["choices"][0]
            assert a["token_ids"] == b["token_ids"] and a["finish_reason"] == b["finish_reason"]
            assert [c["token_id"] for c in a["logprobs"]["content"]] == a["token_ids"]
            for x, y in zip(a["logprobs"]["content"], b["logprobs"]["content"], strict=True):
                assert abs(x["logprob"] - y["logprob"]) < 1e-3
                assert [t["token_id"] for t in x["top_logprobs"]] == [
                    t["token_id"] for t in y["top_logprobs"]
                ][: len(x["top_logprobs"])]
            # One span, all tokens, of the version the server serves (earlier tests pushed some).
            ((span),) = a["weight_versions"]
            assert (span["start"], span["end"]) == (0, len(a["token_ids"]))
            assert int(span["version"]) >= 0
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}],
                "max_tokens": 7}  # fmt: skip
        ours_render = (
            await client.post(f"{edge}/v1/chat/completions/render", json={**chat, "model": ""})
        ).json()
        theirs_render = (
            await client.post(f"{vllm_http}/v1/chat/completions/render", json=chat)
        ).json()
        assert ours_render["token_ids"] == theirs_render["token_ids"]
        assert ours_render["sampling_params"]["max_tokens"] == 7
        # The render is the request that serves the chat: post it as it came.
        generated = await client.post(
            f"{edge}/inference/v1/generate",
            json={k: v for k, v in ours_render.items() if k != "features"},
        )
        assert (
            generated.status_code == 200 and len(generated.json()["choices"][0]["token_ids"]) == 7
        )
        # A sampling key this server does not know is refused by name, not ignored.
        refused = await client.post(
            f"{edge}/inference/v1/generate",
            json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "best_of_n": 3}},
        )
        assert refused.status_code == 400 and "best_of_n" in refused.json()["error"]["message"]
