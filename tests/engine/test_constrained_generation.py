"""Constrained generation on a real engine through the client: logit bias, allowed tokens and
structured outputs (a JSON schema under sampling, a regex, a choice), and constraints that
cannot compile refused before the engine sees them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trainer_client import FinishReason, InferenceClient, InvalidArgument

pytestmark = [pytest.mark.engine]

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "score": {"type": "integer"},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}


@pytest.fixture
async def client(one_server_router: Any, engine_server: Any) -> Any:
    client = InferenceClient(one_server_router.address, [engine_server.address])
    yield client
    await client.close()


async def test_logit_bias_and_allowed_tokens_steer_every_position(client: InferenceClient) -> None:
    biased = await client.generate(
        [1, 45, 722],
        {
            "temperature": 0.0,
            "max_tokens": 8,
            "ignore_eos": True,
            "logit_bias": {77: 100.0},
        },
    )
    assert biased.token_ids == [77] * 8
    allowed = await client.generate(
        [1, 45, 722],
        {
            "temperature": 1.0,
            "seed": 3,
            "max_tokens": 16,
            "ignore_eos": True,
            "allowed_token_ids": [10, 11, 12],
        },
    )
    assert set(allowed.token_ids) <= {10, 11, 12}


async def test_every_sampled_output_satisfies_its_json_schema(client: InferenceClient) -> None:
    prompt = await client.tokenize("Answer in JSON:")
    results = await client.sample(
        prompt,
        {"temperature": 1.0, "max_tokens": 400, "structured_output": {"json_schema": SCHEMA}},
        n=64,
        include_text=True,
    )
    assert len(results) == 64
    for result in results:
        assert result.finish_reason == FinishReason.STOP, result.text  # the grammar ended it
        value = json.loads(result.text or "")
        assert set(value) == {"answer", "score"} and value["answer"] in ("yes", "no")
        assert isinstance(value["score"], int)


async def test_regex_and_choice_constraints(client: InferenceClient) -> None:
    prompt = await client.tokenize("Pick:")
    picked = await client.generate(
        prompt,
        {"temperature": 1.0, "max_tokens": 16, "structured_output": {"choice": ["red", "blue"]}},
        include_text=True,
    )
    assert picked.text in ("red", "blue")
    code = await client.generate(
        prompt,
        {"temperature": 1.0, "max_tokens": 16, "structured_output": {"regex": "[A-Z]{3}-[0-9]{2}"}},
        include_text=True,
    )
    assert code.text is not None and len(code.text) == 6 and code.text[3] == "-"


@pytest.mark.parametrize(
    ("sampling", "words"),
    [
        ({"structured_output": {"json_schema": "{not json"}}, "not valid JSON"),
        ({"structured_output": {"json_schema": "[1, 2]"}}, "must be a JSON object"),
        # Valid JSON that the engine's grammar compiler rejects: refused as it is taken.
        ({"structured_output": {"json_schema": '{"type": "banana"}'}}, "engine refused"),
        ({"structured_output": {"regex": "([a-z"}}, "does not compile"),
        ({"structured_output": {"choice": []}}, "lists no choice"),
        ({"structured_output": {"grammar": "x" * 70_000}}, "the limit is 65536"),
        ({"logit_bias": {5: 101.0}}, "must be in -100..100"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ],
)
async def test_constraints_that_cannot_work_are_refused_naming_them(
    client: InferenceClient, sampling: dict[str, Any], words: str
) -> None:
    with pytest.raises(InvalidArgument, match=words.replace("(", r"\(").replace("[", r"\[")):
        await client.generate([1, 2, 3], {"max_tokens": 4, **sampling})
    assert len((await client.generate([1, 2, 3], {"max_tokens": 4})).token_ids) == 4


async def test_the_openai_edge_takes_response_format_and_logit_bias(http_router: Any) -> None:
    import openai

    sdk = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{http_router.http_port}/v1", api_key="unused", max_retries=0
    )
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    answers = await sdk.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Answer in JSON"}],
        max_tokens=400,
        temperature=1.0,
        n=64,
        response_format=response_format,
    )
    assert len(answers.choices) == 64
    for choice in answers.choices:
        assert choice.finish_reason == "stop"
        assert json.loads(choice.message.content or "")["answer"] in ("yes", "no")
    biased = await sdk.completions.create(
        model="", prompt=[1, 45, 722], max_tokens=6, temperature=0.0,
        logit_bias={"77": 100}, extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert biased.choices[0].model_extra["token_ids"] == [77] * 6  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="regex does not compile"):
        await sdk.completions.create(
            model="", prompt="x", max_tokens=4, extra_body={"structured_outputs": {"regex": "("}}
        )
    await sdk.close()
