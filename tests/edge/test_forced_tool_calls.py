"""Forced tool choices on servers started without ``--tool-call-parser`` (the shared default
engine servers): ``required`` and a named function constrain the output to the tools' JSON
schema and come back as tool calls, whole and streamed, through the OpenAI edge (read by the
OpenAI SDK) and through the gRPC contract (the generated stub). ``auto``, which has to read
calls out of free text in the model's own format, is still refused naming the flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from skyrl_grpc.v1 import chat_tools_pb2, data_plane_pb2, data_plane_pb2_grpc, generation_pb2
from tests.helpers.forced_calls import NAMED, SEEDS, broken_forced_answers, forced_request
from tests.helpers.openai_http import no_whitespace as whitespace_bias

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
SCHEMAS = {"get_time": ZONE, "get_weather": CITY}
TOOLS: Any = [
    {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
MESSAGES: Any = [{"role": "user", "content": "What time is it in Paris?"}]
CHOICES: dict[str, Any] = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
}
# Enough for a whole call of these schemas.
CALL_TOKENS = 96


@pytest.fixture(scope="module")
def no_whitespace(tiny_model_dir: Path) -> dict[int, float]:
    """A bias against whitespace-only tokens: a JSON constraint allows any whitespace between
    tokens, and a random model writes little else; with this its calls end."""
    return whitespace_bias(tiny_model_dir)


def check_calls(choice: str, calls: list[tuple[str, str]]) -> None:
    """The calls name offered tools, their arguments parse as JSON and satisfy the schema."""
    assert calls, "a forced choice must return a call"
    for name, arguments in calls:
        assert name in SCHEMAS, name
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if choice == "named":
        assert {name for name, _ in calls} == {"get_weather"}
    else:
        assert len(calls) == 1  # parallel_tool_calls is off


@pytest.mark.parametrize("choice", list(CHOICES))
async def test_the_openai_sdk_gets_forced_calls_from_a_server_without_a_parser(
    http_router: Any, no_whitespace: dict[int, float], choice: str
) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{http_router.http_port}/v1", api_key="-"
    )
    request: Any = {
        "model": "",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": CHOICES[choice],
        "parallel_tool_calls": False,
        "max_tokens": CALL_TOKENS,
        "temperature": 0.0,
        "logit_bias": {str(k): v for k, v in no_whitespace.items()},
    }
    answer = await client.chat.completions.create(**request)
    message = answer.choices[0].message
    whole = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    check_calls(choice, whole)
    # OpenAI's rule, as vLLM's server keeps it: "tool_calls" for required, "stop" for named.
    assert answer.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert all(c.type == "function" and c.id for c in message.tool_calls or [])

    folded: dict[int, list[str]] = {}
    finish = None
    async for chunk in await client.chat.completions.create(**request, stream=True):
        for streamed in chunk.choices:
            for piece in streamed.delta.tool_calls or []:
                entry = folded.setdefault(piece.index, ["", ""])
                if piece.function is not None:
                    entry[0] += piece.function.name or ""
                    entry[1] += piece.function.arguments or ""
            finish = streamed.finish_reason or finish
    check_calls(choice, [(name, arguments) for name, arguments in folded.values()])
    assert [(n, json.loads(a)) for n, a in folded.values()] == [
        (n, json.loads(a)) for n, a in whole
    ]  # greedy: streamed as answered whole
    assert finish == answer.choices[0].finish_reason
    await client.close()


def tool_use(choice: str) -> chat_tools_pb2.ToolUse:
    tools = [
        chat_tools_pb2.Tool(name=name, description=name, parameters_json=json.dumps(schema))
        for name, schema in SCHEMAS.items()
    ]
    picked = (
        chat_tools_pb2.ToolChoice(mode=chat_tools_pb2.TOOL_CHOICE_MODE_REQUIRED)
        if choice == "required"
        else chat_tools_pb2.ToolChoice(function_name="get_weather")
    )
    return chat_tools_pb2.ToolUse(tools=tools, tool_choice=picked, parallel_tool_calls=False)


@pytest.mark.parametrize("choice", list(CHOICES))
async def test_the_grpc_stub_gets_forced_calls_from_a_server_without_a_parser(
    http_router: Any, no_whitespace: dict[int, float], choice: str
) -> None:
    sampling = generation_pb2.SamplingParams(
        temperature=0.0, max_tokens=CALL_TOKENS, logit_bias=no_whitespace
    )
    messages = [data_plane_pb2.ChatMessage(role="user", content=MESSAGES[0]["content"])]
    async with grpc.aio.insecure_channel(http_router.address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)
        answer = await stub.Chat(
            data_plane_pb2.ChatRequest(
                messages=messages, sampling_params=sampling, tool_use=tool_use(choice)
            )
        )
        whole = [(c.name, c.arguments_json) for c in answer.messages[0].tool_calls]
        check_calls(choice, whole)
        assert all(c.id for c in answer.messages[0].tool_calls)
        # Streamed: the same call as ChatDelta pieces, on the prompt Chat rendered.
        stream = stub.GenerateStream(
            data_plane_pb2.GenerateStreamRequest(
                prompt_token_ids=answer.prompt_token_ids,
                sampling_params=sampling,
                chat_output=chat_tools_pb2.ChatOutput(tool_use=tool_use(choice)),
            )
        )
        folded: dict[int, list[str]] = {}
        async for message in stream:
            for piece in message.chat_delta.tool_calls:
                entry = folded.setdefault(piece.index, ["", ""])
                entry[0] += piece.name
                entry[1] += piece.arguments
    assert [(n, json.loads(a)) for n, a in folded.values()] == [
        (n, json.loads(a)) for n, a in whole
    ]


async def test_auto_without_a_parser_is_refused_naming_the_flag(http_router: Any) -> None:
    """Through the edge (400) and the contract (FAILED_PRECONDITION); the server serves on."""
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{http_router.http_port}/v1", api_key="-"
    )
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="", messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=4
        )
    assert "--tool-call-parser" in str(refused.value)
    auto = chat_tools_pb2.ToolUse(
        tools=tool_use("required").tools,
        tool_choice=chat_tools_pb2.ToolChoice(mode=chat_tools_pb2.TOOL_CHOICE_MODE_AUTO),
    )
    messages = [data_plane_pb2.ChatMessage(role="user", content="hi")]
    async with grpc.aio.insecure_channel(http_router.address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.Chat(data_plane_pb2.ChatRequest(messages=messages, tool_use=auto))
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--tool-call-parser" in str(failed.value.details())
        served = await stub.Chat(
            data_plane_pb2.ChatRequest(messages=messages, sampling_params={"max_tokens": 2})
        )
        assert served.samples[0].token_ids
    await client.close()


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
async def test_seeded_forced_calls_are_calls_or_keep_their_text(
    http_router: Any, choice: Any
) -> None:
    """Seeded, with free string arguments a random model writes long: every answer is calls that
    follow the schema, or (cut off) the generated text as content; never "tool_calls" with no
    call, never a call whose arguments break the schema."""
    edge = f"http://127.0.0.1:{http_router.http_port}/v1"
    client = openai.AsyncOpenAI(base_url=edge, api_key="-")
    answers = [
        (await client.chat.completions.create(**forced_request(choice, seed))).model_dump()
        for seed in SEEDS
    ]
    await client.close()
    assert broken_forced_answers(choice, answers) == []


# The tools: short string arguments, so a required answer of 120 tokens holds a complete
# call before it is cut in the middle of the next one.
SHORT_SCHEMAS: dict[str, Any] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
    "search": {
        "type": "object",
        "properties": {"q": {"type": "string", "maxLength": 12}},
        "required": ["q"],
    },
}
SHORT_TOOLS: Any = [
    {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
    for name, schema in SHORT_SCHEMAS.items()
]
CUT_SEEDS = range(8)


def complete_calls_in(text: str, choice: Any) -> list[tuple[str, Any]]:
    """The calls a forced answer's text holds whole (name, arguments), read with the standard
    library's JSON decoder: for ``required`` the array's elements up to the first one cut, for
    a named choice its one object if it is closed."""
    decoder = json.JSONDecoder()
    if isinstance(choice, dict):
        try:
            arguments, _ = decoder.raw_decode(text.lstrip())
        except json.JSONDecodeError:
            return []
        return [(choice["function"]["name"], arguments)]
    calls: list[tuple[str, Any]] = []
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return calls
    at += 1
    while True:
        at += len(text[at:]) - len(text[at:].lstrip())
        try:
            element, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return calls
        calls.append((element["name"], element["parameters"]))
        at += len(text[at:]) - len(text[at:].lstrip())
        if not text.startswith(",", at):
            return calls
        at += 1


# What the seeds must show, per choice: a required answer cut after a complete call (the issue's
# case); a named choice's one object ends its output (its grammar's end), so its cut-offs have no
# complete call and keep their text, at a max_tokens that cuts some of them.
CUT_CASES = {
    "required": ("required", 120, {"cut after calls"}),
    "named": (NAMED, 40, {"cut, no call", "called"}),
}


@pytest.mark.parametrize("case", list(CUT_CASES))
async def test_a_cut_off_forced_answer_returns_the_calls_it_completed(
    http_router: Any, tiny_model_dir: Path, case: str
) -> None:
    """The issue's requests (seeded): an answer cut off by max_tokens returns every call its
    text completed, in tool_calls with finish_reason "length", and nothing of the cut
    remainder; with none complete, its text as content. Streamed, each call comes whole in one
    delta, the same calls, content and finish as the whole answer."""
    choice, max_tokens, must_see = CUT_CASES[case]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{http_router.http_port}/v1", api_key="-"
    )
    seen = set()
    for seed in CUT_SEEDS:
        request: Any = {
            "model": "",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": SHORT_TOOLS,
            "tool_choice": choice,
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "seed": seed,
        }
        answer = await client.chat.completions.create(
            **request, extra_body={"return_token_ids": True}
        )
        (first,) = answer.choices
        text = tokenizer.decode(first.token_ids, skip_special_tokens=True)
        expected = complete_calls_in(text, choice)
        calls = [
            (c.function.name, json.loads(c.function.arguments))
            for c in first.message.tool_calls or []
        ]
        where = f"seed {seed} ({first.finish_reason}): {text!r}"
        assert calls == expected, where
        for name, arguments in calls:
            jsonschema.validate(arguments, SHORT_SCHEMAS[name])
        if expected:
            assert first.message.content == "", where  # the cut remainder nowhere
        else:
            assert first.message.content == text, where  # no call: the generated text
        cut = first.finish_reason == "length"
        seen.add(
            ("cut after calls" if cut else "called")
            if expected
            else "cut, no call"
            if cut
            else "no call"
        )

        pieces: dict[int, list[Any]] = {}
        content, finish = "", None
        async for chunk in await client.chat.completions.create(**request, stream=True):
            for streamed_choice in chunk.choices:
                content += streamed_choice.delta.content or ""
                for piece in streamed_choice.delta.tool_calls or []:
                    pieces.setdefault(piece.index, []).append(piece)
                finish = streamed_choice.finish_reason or finish
        assert all(len(deltas) == 1 for deltas in pieces.values()), where  # each call whole
        streamed = [
            (deltas[0].function.name, json.loads(deltas[0].function.arguments))
            for _, deltas in sorted(pieces.items())
        ]
        assert all(deltas[0].id and deltas[0].type == "function" for deltas in pieces.values())
        assert (streamed, content, finish) == (calls, first.message.content, first.finish_reason)
    await client.close()
    assert must_see <= seen, seen  # the seeds hold the cases this choice is about
