"""SMG, the Rust gateway, reading tool calls out of what this stack's engine server generates
over vLLM's protocol: its own tool-call parser on free text in Hermes' markup, and a call forced
by name (a JSON schema SMG hands the server), whole and streamed. The model is the embedded
one with a Hermes tool template; a random model writes no call of its own, so the free text is
held to a call's markup by a regex and the forced call to compact JSON by the server's
structured-outputs settings (vLLM's servicer takes no logit bias)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from servers.fleet.gateway import SmgGateway
from skyrl_grpc.tiny_model import TINY_MODEL_NAME as MODEL
from tests.conftest import running_engine_server
from tests.helpers.hermes_stack import MESSAGES, MODEL_THREADS, TOOLS, hermes_model
from tests.helpers.smg import smg_over

pytestmark = [pytest.mark.engine]
# Hermes' markup (Qwen's too: SMG's "qwen" parser reads it) around one call.
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_TOKENS = 200


@pytest.fixture(scope="module")
async def smg_with_parser() -> AsyncIterator[SmgGateway]:
    """An engine server on the Hermes-template model, compact JSON under a schema, and SMG
    over it with its Hermes-style parser."""
    model: Path = hermes_model()
    async for server in running_engine_server(
        model=str(model),
        served_model_name=MODEL,
        dtype="float32",
        cpu_threads=MODEL_THREADS,
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    ):
        async with smg_over([server.address], "--tool-call-parser", "qwen") as gateway:
            yield gateway


async def whole_and_streamed(base: str, **request: Any) -> tuple[Any, list[Any]]:
    """One chat answer whole, and its streamed chunks."""
    sdk = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
    body: Any = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0, **request)
    try:
        whole = await sdk.chat.completions.create(**body, max_tokens=CALL_TOKENS)
        stream = await sdk.chat.completions.create(**body, max_tokens=CALL_TOKENS, stream=True)
        chunks = [chunk async for chunk in stream]
    finally:
        await sdk.close()
    return whole, chunks


def streamed_calls(chunks: list[Any]) -> tuple[list[tuple[str, str]], str | None]:
    """The calls the chunks spell (name, arguments), and the finish reason they end with."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                if call.function.name:
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (
                    call.function.arguments or ""
                )
    return [(names[i], arguments[i]) for i in sorted(names)], finish


async def test_smg_parses_a_call_in_free_text_whole_and_streamed(
    smg_with_parser: SmgGateway,
) -> None:
    whole, chunks = await whole_and_streamed(
        smg_with_parser.base, tool_choice="auto", extra_body={"regex": re.escape(CALL)}
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})]
    streamed, finish = streamed_calls(chunks)
    assert [(name, json.loads(args)) for name, args in streamed] == calls
    assert finish == "tool_calls"


async def test_smg_forces_a_call_by_name_whole_and_streamed(smg_with_parser: SmgGateway) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    whole, chunks = await whole_and_streamed(smg_with_parser.base, tool_choice=named)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    arguments = json.loads(call.function.arguments)
    assert arguments["zone"] in ("UTC", "CET")  # held to the tool's schema
    assert streamed_calls(chunks) == ([("get_time", call.function.arguments)], "tool_calls")


async def test_a_second_gateway_starts_beside_the_first(smg_with_parser: SmgGateway) -> None:
    """Each gateway's metrics get a port of their own on its host (SMG's default, 29000 on
    every interface, kept a second one on the same host from starting)."""
    first = smg_with_parser
    servers = [url.removeprefix("grpc://") for url in await asyncio.to_thread(first.workers)]
    async with httpx.AsyncClient(timeout=10) as http:
        served = (await http.get(f"{first.base}/v1/models")).json()
        async with smg_over(servers) as second:
            assert (await http.get(f"{second.base}/v1/models")).json() == served
            metrics = await http.get(f"http://127.0.0.1:{second.metrics_port}/metrics")
            assert metrics.status_code == 200 and "smg_" in metrics.text
