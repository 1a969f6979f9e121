"""Both OpenAI servers on the embedded model built with a Hermes-style tool template, each with
vLLM's ``hermes`` tool parser: this stack (an engine server behind a router's edge) and vLLM's
own server. What the tool-calling tests and the edge's differential test run against."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from skyrl_grpc.tiny_model import TinyModelSpec, ensure_tiny_model
from tests.helpers.vllm_http import SERVED_NAME, vllm_http_server

# The hermes model is tiny too: one model thread, as the embedded model gets. By default a
# --model directory gets vLLM's per-core binding, whose OpenMP threads spin on both cores that
# the other test worker needs.
MODEL_THREADS = 1
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "strict": True,  # arguments held to the schema: short, so calls finish
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS: list[dict[str, Any]] = [WEATHER, TIME]
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]


def hermes_model() -> Path:
    # The tool prompt (template text and two schemas) is longer than the default 512 tokens.
    return ensure_tiny_model(
        spec=TinyModelSpec(chat_template="hermes", max_position_embeddings=2048)
    )


async def our_edge(model_dir: Path, **engine: Any) -> AsyncIterator[Any]:
    """This stack: an engine server with vLLM's hermes parser (``engine``: more or other
    EngineOptions fields), behind a router with its HTTP edge; yields the router."""
    from tests.conftest import running_engine_server, running_router

    options = dict(tool_call_parser="hermes", enable_auto_tool_choice=True, **engine)
    async for server in running_engine_server(
        model=str(model_dir),
        served_model_name=SERVED_NAME,
        dtype="float32",
        cpu_threads=MODEL_THREADS,
        **options,
    ):
        async for router in running_router([server.address], http_port=0):
            yield router


async def vllms_edge(model_dir: Path) -> AsyncIterator[str]:
    """vLLM's own OpenAI server on the same model and template, with the same parser, and its
    token-in / token-out and render endpoints (off by default in vLLM's server); yields its
    base URL. Started in a thread: the in-process engine servers keep serving."""
    server = vllm_http_server(model=model_dir, extra_args=(*TOOL_FLAGS, "--enable-scale-out"))
    base_url = await asyncio.to_thread(server.__enter__)
    yield base_url
    await asyncio.to_thread(server.__exit__, None, None, None)
