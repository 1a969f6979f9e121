"""The OpenAI HTTP edge with the real OpenAI SDK, through a router, against real vLLM engine
servers (tiny model)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from skyrl_grpc.names import GENERATE_STREAM
from tests.helpers.waits import failing_while_paused, until
from trainer_client import InferenceClient

pytestmark = pytest.mark.engine
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture
async def sdk(http_router: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{http_router.http_port}/v1", api_key="unused", max_retries=0
    )
    yield client
    await client.close()


async def test_completions_whole_and_streamed_match_the_grpc_path(
    http_router: Any, sdk: openai.AsyncOpenAI
) -> None:
    prompt = [1, 17, 33, 95, 200, 311]
    client = InferenceClient(http_router.address)
    expected = await client.generate(prompt, GREEDY, include_text=True)
    whole = await sdk.completions.create(
        model="", prompt=prompt, max_tokens=12, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    first = whole.choices[0]
    assert first.model_extra is not None and first.model_extra["token_ids"] == expected.token_ids
    assert first.model_extra["prompt_token_ids"] == prompt
    assert first.text == expected.text and first.finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == len(prompt)
    stream = await sdk.completions.create(
        model="", prompt=prompt, max_tokens=12, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts, finishes, usage = [], [], None
    async for event in stream:
        for c in event.choices:
            texts.append(c.text)
            finishes.append(c.finish_reason)
        usage = event.usage or usage
    assert "".join(texts) == expected.text and finishes[-1] == "length"
    assert usage is not None and usage.completion_tokens == 12


async def test_chat_whole_and_streamed_with_n_samples_and_logprobs(sdk: openai.AsyncOpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "hello there"}]
    whole = await sdk.chat.completions.create(
        model="", messages=messages, max_tokens=8, temperature=0.0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    answer = whole.choices[0]
    assert answer.message.role == "assistant" and answer.finish_reason == "length"
    assert answer.logprobs is not None and answer.logprobs.content is not None
    assert len(answer.logprobs.content) == 8
    for position in answer.logprobs.content:
        assert len(position.top_logprobs) == 2, position
        assert position.logprob <= 1e-6, position
    assert "".join(t.token for t in answer.logprobs.content) == answer.message.content
    stream = await sdk.chat.completions.create(
        model="", messages=messages, max_tokens=8, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    parts = [c.delta.content or "" async for event in stream for c in event.choices]
    assert "".join(parts) == answer.message.content
    several = await sdk.chat.completions.create(
        model="", messages=messages, max_tokens=8, temperature=1.0, n=3, seed=5,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert sorted(c.index for c in several.choices) == [0, 1, 2]
    assert all(len(c.model_extra["token_ids"]) == 8 for c in several.choices)  # type: ignore[index]
    assert several.model_extra is not None and several.model_extra["prompt_token_ids"]
    completions = await sdk.completions.create(
        model="", prompt="abc", max_tokens=6, n=2, logprobs=1, temperature=1.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert len(completions.choices) == 2
    for c in completions.choices:
        assert c.logprobs is not None and c.logprobs.token_logprobs is not None
        assert len(c.logprobs.token_logprobs) == 6 and c.logprobs.top_logprobs is not None


async def test_a_five_turn_session_stays_on_one_server_and_its_tokens_round_trip(
    http_router: Any, sdk: openai.AsyncOpenAI
) -> None:
    def served() -> dict[str, float]:
        return {
            b.address: http_router.metrics.registry.get_sample_value(
                "skyrl_router_processed_requests_total",
                {"method": GENERATE_STREAM, "worker": b.address},
            )
            or 0.0
            for b in http_router.pool.backends
        }

    transcript = list(range(3, 140))
    before = served()
    cached = []
    for turn in range(5):
        answer = await sdk.completions.create(
            model="", prompt=transcript, max_tokens=6, temperature=0.0,
            extra_headers={"X-Session-ID": "http-agent-1"},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        extra = answer.choices[0].model_extra
        assert extra is not None and extra["prompt_token_ids"] == transcript
        transcript = transcript + extra["token_ids"] + [40 + turn, 41 + turn]
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
    grew = {a: n - before[a] for a, n in served().items()}
    assert sorted(grew.values()) == [0, 5], grew  # all five turns on one server
    assert cached[-1] and cached[-1] >= 128  # and its prefix cache served them


async def test_bad_requests_get_openai_errors_and_a_disconnect_frees_the_engine(
    http_router: Any, sdk: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.completions.create(model="", prompt=[1, 2], max_tokens=-1)
    assert bad.value.status_code == 400 and "max_tokens" in str(bad.value.message)
    assert isinstance(bad.value.body, dict) and bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        await sdk.completions.create(model="", prompt=[1, 10**6], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await sdk.completions.create(model="no-such-model", prompt=[1], max_tokens=2)
    models = await sdk.models.list()
    assert [m.id for m in models.data] and models.data[0].id
    client = InferenceClient(http_router.address, [b.address for b in http_router.pool.backends])

    def cancelled() -> float:
        return float(
            sum(  # on whichever worker the stream ran
                sample.value
                for metric in http_router.metrics.registry.collect()
                for sample in metric.samples
                if sample.name == "skyrl_router_request_errors_total"
                and sample.labels["method"] == GENERATE_STREAM
                and sample.labels["code"] == "CANCELLED"
            )
        )

    before = cancelled()
    stream = await sdk.completions.create(
        model="", prompt=[1, 2, 3], max_tokens=500, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for _ in stream:
        break  # the first event arrived: hang up
    await stream.close()
    # The router saw the call cancelled (not finished), and the engines stopped generating.
    await until(lambda: cancelled() == before + 1, what="the stream to be cancelled upstream")

    async def idle() -> bool:
        loads = await client.server_loads()
        return all(
            load.running_requests == 0 and load.waiting_requests == 0 for load in loads.values()
        )

    await until(idle, what="the engines to go idle after the disconnect")


@pytest.mark.parametrize("stream", [False, True])
async def test_one_failing_prompt_cancels_the_others_of_its_request(
    http_router: Any, engine_server: Any, second_engine_server: Any, stream: bool
) -> None:
    import httpx

    client = InferenceClient(
        http_router.address, [engine_server.address, second_engine_server.address]
    )
    body = {
        "model": "",
        "prompt": [[1, 2, 3], [1, 4, 5], [1, 6, 7], [1, 99999]],  # the last is out of vocabulary
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": stream,
    }

    async def post() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.post(
                f"http://127.0.0.1:{http_router.http_port}/v1/completions", json=body
            )
        text = response.text
        if response.status_code == 400 or '"error"' in text:
            raise RuntimeError(text)

    error = await failing_while_paused(client, post())
    assert "99999" in str(error) or "vocab" in str(error)


async def test_several_prompts_of_one_request_on_one_server(http_router: Any) -> None:
    # A session puts every prompt on one server: their request ids must not collide there.
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"http://127.0.0.1:{http_router.http_port}/v1/completions",
            json={"model": "", "prompt": [[1, 2, 3], [1, 4, 5], [1, 6, 7]], "max_tokens": 40,
                  "ignore_eos": True},
            headers={"X-Session-ID": "one-server"},
        )  # fmt: skip
    assert response.status_code == 200, response.text
    assert sorted(c["index"] for c in response.json()["choices"]) == [0, 1, 2]
