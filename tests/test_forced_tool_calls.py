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
    whole = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]  # type: ignore[union-attr]
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
