"""The OpenAI HTTP edge against vLLM's own OpenAI server, on the whole surface agent harnesses
use: the same requests to both (the embedded model with a Hermes-style tool template, vLLM's
``hermes`` parser on both sides), answers compared field by field, whole and streamed, chat and
completions: greedy and seeded sampling, ``n``, ``logprobs`` / ``top_logprobs``, ``stop``,
``logit_bias``, ``max_tokens`` cut-offs, ``response_format`` (``json_object``, ``json_schema``),
structured outputs (``regex``, ``choice``, ``json``), tools with ``auto``, ``required``, a named
function and ``none``, a tool conversation's prompt, and vLLM's token-in / token-out and render
endpoints. What is left different is in ``tests.helpers.openai_compare.DOCUMENTED`` and
docs/serving.md, each with why."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.hermes_stack import MESSAGES, TOOLS, hermes_model, our_edge, vllms_edge
from tests.helpers.openai_compare import compare_streams, compare_whole
from tests.helpers.openai_http import no_whitespace, streamed, whole
from tests.helpers.vllm_http import SERVED_NAME

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return hermes_model()


@pytest.fixture(scope="module")
async def edge(model_dir: Path) -> AsyncIterator[str]:
    async for router in our_edge(model_dir):
        yield f"http://127.0.0.1:{router.http_port}"


@pytest.fixture(scope="module")
async def vllm_edge(model_dir: Path) -> AsyncIterator[str]:
    async for base_url in vllms_edge(model_dir):
        yield base_url


@pytest.fixture(scope="module")
def bias(model_dir: Path) -> dict[str, float]:
    return {str(k): v for k, v in no_whitespace(model_dir).items()}


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
# Sampling cases for chat and completions alike (what a harness sends beside its prompt).
SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": {"max_tokens": 12, "temperature": 0.0},
    "cut off by max_tokens": {"max_tokens": 2, "temperature": 0.0},
    "seeded": {"max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 7},
    "n samples, seeded": {"max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 3},
    "stop string": {"max_tokens": 40, "temperature": 0.0, "stop": ["a", "e"]},
    "stop token ids": {
        "max_tokens": 40,
        "temperature": 0.0,
        "stop_token_ids": list(range(300, 700)),
    },
    "logit_bias": {"max_tokens": 5, "temperature": 0.0, "logit_bias": {"65": 100}},
    "token ids returned": {"max_tokens": 6, "temperature": 0.0, "return_token_ids": True},
    "penalties, top_k, min_p": {
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": 1,
        "top_k": 20,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
    },
    "regex": {"max_tokens": 12, "temperature": 0.0, "structured_outputs": {"regex": "[a-z]{3,9}"}},
    "choice": {
        "max_tokens": 12,
        "temperature": 0.0,
        "structured_outputs": {"choice": ["sunny", "rainy", "windy"]},
    },
    "structured json": {
        "max_tokens": 40,
        "temperature": 0.0,
        "structured_outputs": {"json": SCHEMA},
        "no_whitespace": True,
    },
    "usage in the stream": {  # streamed only: whole, both refuse stream_options (400)
        "max_tokens": 6,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    },
}
# Chat only: logprobs as chat asks for them, response_format, tools.
LOOSE_TOOLS = [{**t, "function": {k: v for k, v in t["function"].items() if k != "strict"}}
               for t in TOOLS]  # fmt: skip
# A hermes call the model is held to (auto choice with a regex): the parser must find it.
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}\n</tool_call>'
)
CALL_TOKENS = 160
CHAT: dict[str, dict[str, Any]] = {
    "logprobs, top 3": {"max_tokens": 6, "temperature": 0.0, "logprobs": True, "top_logprobs": 3},
    "json_object": {
        "max_tokens": 24,
        "temperature": 0.0,
        "response_format": {"type": "json_object"},
        "no_whitespace": True,
    },
    "json_schema": {
        "max_tokens": 40,
        "temperature": 0.0,
        "no_whitespace": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
    },
    # Strict tools (arguments held to their schema on both sides; for tools that are not
    # strict the edge holds forced calls to the schema where vLLM's server does not:
    # test_tool_calling.test_seeded_forced_calls_under_a_parser_follow_the_schema).
    "tools, required": {
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": CALL_TOKENS,
        "temperature": 0.0,
        "no_whitespace": True,
    },
    "tools, named": {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "max_tokens": CALL_TOKENS,
        "temperature": 0.0,
        "no_whitespace": True,
    },
    "tools, auto, no call": {
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 24,
        "temperature": 0.0,
    },
    # Held to one hermes call by a regex (tools not strict: their grammar would replace it).
    "tools, auto, a call": {
        "tools": LOOSE_TOOLS,
        "tool_choice": "auto",
        "max_tokens": CALL_TOKENS,
        "temperature": 0.0,
        "structured_outputs": {"regex": HERMES_CALL},
    },
    "tools, none": {"tools": TOOLS, "tool_choice": "none", "max_tokens": 12, "temperature": 0.0},
}
COMPLETIONS: dict[str, dict[str, Any]] = {
    "logprobs, top 2": {"max_tokens": 6, "temperature": 0.0, "logprobs": 2},
    "echo-free prompt of token ids": {"max_tokens": 6, "temperature": 0.0, "prompt": [1, 45, 722]},
}


def request(case: dict[str, Any], chat: bool, bias: dict[str, float]) -> dict[str, Any]:
    body = {k: v for k, v in case.items() if k != "no_whitespace"}
    if case.get("no_whitespace"):
        body["logit_bias"] = bias
    if chat:
        return {"model": SERVED_NAME, "messages": MESSAGES, **body}
    return {"model": SERVED_NAME, "prompt": "The weather in Paris is", **body}


async def compared(edge: str, vllm_edge: str, body: dict[str, Any]) -> tuple[Any, list[str]]:
    """Our whole answer, and every difference from vLLM's, whole and streamed (a request only
    a stream takes: both refuse it whole)."""
    async with httpx.AsyncClient(timeout=120) as client:
        if "stream_options" in body:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            ours = (await client.post(f"{edge}{path}", json=body)).json()
            theirs = (await client.post(f"{vllm_edge}{path}", json=body)).json()
            assert ours["error"]["code"] == theirs["error"]["code"] == 400, (ours, theirs)
            assert "stream_options" in ours["error"]["message"]
            found = []
        else:
            ours, theirs = await whole(client, edge, body), await whole(client, vllm_edge, body)
            found = compare_whole(ours, theirs)
        ours_events = await streamed(client, edge, body)
        theirs_events = await streamed(client, vllm_edge, body)
    found += [f"streamed: {d}" for d in compare_streams(ours_events, theirs_events)]
    return ours, found


@pytest.mark.parametrize("case", [*SAMPLING, *CHAT])
async def test_chat_answers_match_vllms_server_field_by_field(
    edge: str, vllm_edge: str, bias: dict[str, float], case: str
) -> None:
    ours, found = await compared(edge, vllm_edge, request({**SAMPLING, **CHAT}[case], True, bias))
    assert found == []
    if "error" in ours:
        return  # a stream-only request: its whole answer was the refusal both gave
    message = ours["choices"][0]["message"]
    if case in ("tools, required", "tools, named", "tools, auto, a call"):
        calls = message.get("tool_calls") or []
        assert calls, ours  # the case is about calls: there must be some to compare
        for call in calls:
            json.loads(call["function"]["arguments"])
    if case == "tools, auto, a call":
        assert ours["choices"][0]["finish_reason"] == "tool_calls"
    if case in ("json_schema", "structured json") and ours["choices"][0]["finish_reason"] == "stop":
        assert set(json.loads(message["content"])) == {"city", "days"}
    if case == "n samples, seeded":
        assert len({c["message"]["content"] for c in ours["choices"]}) > 1  # really sampled


# Parallel calls allowed: the model writes calls until max_tokens cuts one.
CUT_OFF_CALLS = {
    "tools": TOOLS,
    "tool_choice": "required",
    "max_tokens": CALL_TOKENS,
    "temperature": 0.0,
    "no_whitespace": True,
}
HERMES_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


async def test_a_cut_off_required_answer_returns_the_calls_in_vllms_text(
    edge: str, vllm_edge: str, bias: dict[str, float]
) -> None:
    """Where the edge is better than vLLM's server on purpose: cut off by max_tokens after
    complete calls, vLLM's server answers with the whole text as content (streamed: the cut
    call's pieces); the edge answers with every call that text completed, and nothing of the
    cut one, whole and streamed."""
    body = request(CUT_OFF_CALLS, True, bias)
    async with httpx.AsyncClient(timeout=120) as client:
        ours, theirs = await whole(client, edge, body), await whole(client, vllm_edge, body)
        ours_events = await streamed(client, edge, body)
    (answer,), (their_answer,) = ours["choices"], theirs["choices"]
    assert answer["finish_reason"] == their_answer["finish_reason"] == "length"
    assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
    text = their_answer["message"]["content"]
    completed = [json.loads(found) for found in HERMES_CALLS.findall(text)]
    assert completed and not text.endswith("</tool_call>"), text  # calls, then one cut
    calls = [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
        for c in answer["message"]["tool_calls"]
    ]
    assert calls == completed
    assert answer["message"]["content"] == ""
    folded = compare_streams_folded(ours_events)
    assert [(name, json.loads(arguments)) for name, arguments in folded] == [
        (c["name"], c["arguments"]) for c in completed
    ]


def compare_streams_folded(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A stream's calls, each folded from its deltas (the edge sends each whole)."""
    calls: dict[int, list[str]] = {}
    for event in events:
        for choice in event["choices"]:
            assert not choice["delta"].get("content"), choice  # the cut call: nowhere
            for piece in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(piece["index"], ["", ""])
                entry[0] += piece.get("function", {}).get("name") or ""
                entry[1] += piece.get("function", {}).get("arguments") or ""
    return [(name, arguments) for _, (name, arguments) in sorted(calls.items())]


@pytest.mark.parametrize("case", [*SAMPLING, *COMPLETIONS])
async def test_completions_match_vllms_server_field_by_field(
    edge: str, vllm_edge: str, bias: dict[str, float], case: str
) -> None:
    _, found = await compared(
        edge, vllm_edge, request({**SAMPLING, **COMPLETIONS}[case], False, bias)
    )
    assert found == []


async def test_the_comparison_sees_a_difference(edge: str, vllm_edge: str) -> None:
    """The comparison can fail: two different requests are told apart, field by field."""
    body = request(SAMPLING["greedy"], True, {})
    async with httpx.AsyncClient(timeout=120) as client:
        ours = await whole(client, edge, body)
        theirs = await whole(client, vllm_edge, {**body, "max_tokens": 11})
    found = compare_whole(ours, theirs)
    assert any("completion_tokens" in d for d in found), found


async def test_a_tool_conversation_renders_as_vllms_server_renders_it(
    edge: str, vllm_edge: str
) -> None:
    """History with a call and its answer: the same prompt tokens on both servers."""
    call = {"id": "call-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": "rain"},
    ]
    body = {"model": SERVED_NAME, "messages": messages, "tools": TOOLS, "max_tokens": 4,
            "temperature": 0.0, "return_token_ids": True}  # fmt: skip
    ours, found = await compared(edge, vllm_edge, body)
    assert found == []
    assert ours["prompt_token_ids"]


async def test_token_in_token_out_and_render_match_vllms_server(edge: str, vllm_edge: str) -> None:
    """``/inference/v1/generate`` and ``/v1/chat/completions/render`` as vLLM serves them (what
    SkyRL's RemoteInferenceClient posts and reads): the same token ids, logprobs and finish
    reasons for greedy requests, the same rendered prompt, plus each token's weight version."""
    async with httpx.AsyncClient(timeout=120) as client:
        for prompt, extra in (([1, 5, 9, 200], {}), (list(range(3, 40)), {"stop_token_ids": [7]})):
            body = {
                "token_ids": prompt, "model": SERVED_NAME,
                "sampling_params": {"temperature": 0.0, "max_tokens": 12, "logprobs": 2, **extra},
            }  # fmt: skip
            ours = await client.post(f"{edge}/inference/v1/generate", json=body)
            theirs = await client.post(f"{vllm_edge}/inference/v1/generate", json=body)
            assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
            a, b = ours.json()["choices"][0], theirs.json()["choices"][0]
            assert a["token_ids"] == b["token_ids"] and a["finish_reason"] == b["finish_reason"]
            assert [c["token_id"] for c in a["logprobs"]["content"]] == a["token_ids"]
            for x, y in zip(a["logprobs"]["content"], b["logprobs"]["content"], strict=True):
                assert abs(x["logprob"] - y["logprob"]) < 1e-3
                assert [t["token_id"] for t in x["top_logprobs"]] == [
                    t["token_id"] for t in y["top_logprobs"]
                ][: len(x["top_logprobs"])]
            # One span, all tokens, of the version the server serves.
            ((span),) = a["weight_versions"]
            assert (span["start"], span["end"]) == (0, len(a["token_ids"]))
            assert int(span["version"]) >= 0
        chat = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 7}
        ours_render = (await client.post(f"{edge}/v1/chat/completions/render", json=chat)).json()
        theirs_render = (
            await client.post(f"{vllm_edge}/v1/chat/completions/render", json=chat)
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


BAD_REQUESTS: dict[str, dict[str, Any]] = {
    "n over 1 with greedy sampling": {"n": 2, "temperature": 0.0, "max_tokens": 4},
    "an unknown model": {"model": "no-such-model", "max_tokens": 4},
    "max_tokens past the context": {"max_tokens": 100_000},
    "a tool choice naming no offered tool": {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "launch"}},
        "max_tokens": 4,
    },
    "top_logprobs without logprobs past the limit": {"logprobs": True, "top_logprobs": 100},
    "stream_options without a stream": {"stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
async def test_bad_requests_get_the_status_vllms_server_gives(
    edge: str, vllm_edge: str, case: str
) -> None:
    """The same HTTP status and an OpenAI error body (its ``type`` and wording are this
    edge's own: docs/serving.md)."""
    body = {"model": SERVED_NAME, "messages": MESSAGES, **BAD_REQUESTS[case]}
    async with httpx.AsyncClient(timeout=120) as client:
        ours = await client.post(f"{edge}/v1/chat/completions", json=body)
        theirs = await client.post(f"{vllm_edge}/v1/chat/completions", json=body)
    assert ours.status_code == theirs.status_code >= 400, (ours.text, theirs.text)
    error = ours.json()["error"]
    assert error["code"] == ours.status_code and error["message"] and error["type"]
