"""SkyRL 0.4.0's own HTTP client (``RemoteInferenceClient``, unmodified) pointed at the router's
OpenAI edge as its external proxy: its data plane (generate, sample, chat, render, tokenize /
detokenize, finish_session) runs on this stack, two real engine servers behind the router."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
    RemoteInferenceClient,
)

from trainer_client import InferenceClient

pytestmark = pytest.mark.engine


async def skyrl_client(http_router: Any, servers: list[Any]) -> RemoteInferenceClient:
    edge = f"http://127.0.0.1:{http_router.http_port}"
    async with httpx.AsyncClient() as http:
        served = (await http.get(f"{edge}/v1/models")).json()["data"][0]["id"]
    return RemoteInferenceClient(
        proxy_url=edge,
        server_urls=[f"http://{s.address}" for s in servers],  # its control plane: not used
        data_parallel_size=1,
        model_name=served,
    )


def session_spy(servers: list[Any]) -> dict[str, set[str]]:
    """Which servers each session's requests reached, read at the servers' session records."""
    seen: dict[str, set[str]] = {}
    for server in servers:
        sessions = server.state.started.sessions
        touch = sessions.touch

        def spy(session: str, _touch: Any = touch, _address: str = server.address) -> bool:
            seen.setdefault(session, set()).add(_address)
            return bool(_touch(session))

        sessions.touch = spy
    return seen


async def test_skyrl_remote_client_generates_what_the_grpc_path_generates(
    http_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    servers = [engine_server, second_engine_server]
    seen = session_spy(servers)
    skyrl = await skyrl_client(http_router, servers)
    prompts = [[1, 5, 9, 13], [1, 7, 7, 2, 30]]
    greedy = {"max_tokens": 8, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
    output = await skyrl.generate(
        {"prompt_token_ids": prompts, "sampling_params": greedy, "session_ids": ["a", "b"]}
    )
    grpc = InferenceClient(http_router.address, [s.address for s in servers])
    for i, prompt in enumerate(prompts):
        expected = await grpc.generate(
            prompt, {"max_tokens": 8, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
        )
        assert output["response_ids"][i] == list(expected.token_ids)
        assert output["response_logprobs"] is not None
        assert output["response_logprobs"][i] == pytest.approx(list(expected.logprobs or []))
        assert output["stop_reasons"][i] == "length"
        assert output["responses"][i] == await grpc.detokenize(expected.token_ids)
    # A session's turns land on one server.
    for turn in range(3):
        await skyrl.generate(
            {"prompt_token_ids": [[1, 2, 3 + turn]], "sampling_params": greedy,
             "session_ids": ["sticky"]}
        )  # fmt: skip
    assert len(seen["sticky"]) == 1, seen["sticky"]
    await skyrl.finish_session("sticky")
    await grpc.close()
    await skyrl.aclose()


async def test_skyrl_remote_client_samples_chats_and_renders(
    http_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    servers = [engine_server, second_engine_server]
    skyrl = await skyrl_client(http_router, servers)
    sampled = await skyrl.sample(
        {
            "json": {
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 4, 8]}]},
                "num_samples": 3,
                "sampling_params": {"max_tokens": 5, "temperature": 1.0, "seed": 7},
            }
        }
    )
    assert len(sampled["sequences"]) == 3
    for sequence in sampled["sequences"]:
        assert 1 <= len(sequence["tokens"]) <= 5
        assert len(sequence["logprobs"]) == len(sequence["tokens"])
        assert sequence["stop_reason"] in ("stop", "length")
    messages = [{"role": "user", "content": "hello there"}]
    chat = await skyrl.chat_completion(
        {"json": {"model": skyrl.model_name, "messages": messages, "max_tokens": 4}}
    )
    assert chat["choices"][0]["message"]["role"] == "assistant"
    rendered = await skyrl.render_chat_completion(
        {"json": {"model": skyrl.model_name, "messages": messages}}
    )
    grpc = InferenceClient(http_router.address, [s.address for s in servers])
    assert rendered["token_ids"] == await grpc.tokenize(messages=messages)
    assert await skyrl.tokenize(["hello there"]) == [
        await grpc.tokenize("hello there", add_special_tokens=True)
    ]
    await grpc.close()
    await skyrl.aclose()
