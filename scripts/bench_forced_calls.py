"""What free whitespace costs a forced tool call (issue: forced calls cut off).

A JSON grammar allows any whitespace between tokens, and a model that is not trained to call
tools (here the embedded tiny model, random) spends much of its output there. Two engine
servers side by side, one with vLLM's default and one started with
``--structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'``,
answer the same seeded forced requests (``required`` and a named function, two tools with
short string arguments) through the contract's Chat call, interleaved request by request.
Reported per server and choice: output tokens per complete call, the share of answers cut off
by ``max_tokens``, and the calls per answer.

Run: .venv/bin/python -m scripts.bench_forced_calls [--seeds 32] [--max-tokens 120]
     [--output docs/serving.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import grpc

from scripts.bench_common import add_output_argument, write_report
from servers.engine.options import EngineOptions, ServerOptions
from servers.engine.process.engine_server import EngineServer
from skyrl_grpc.v1 import chat_tools_pb2, data_plane_pb2, data_plane_pb2_grpc, generation_pb2

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}},
    "search": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 12}}},
}
COMPACT = {"backend": "xgrammar", "disable_any_whitespace": True}


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
    return chat_tools_pb2.ToolUse(tools=tools, tool_choice=picked)


async def answer(
    stub: data_plane_pb2_grpc.DataPlaneAsyncStub, choice: str, seed: int, max_tokens: int
) -> tuple[int, int, bool]:
    """One seeded forced request: its output tokens, its calls, whether it was cut off."""
    reply = await stub.Chat(
        data_plane_pb2.ChatRequest(
            messages=[data_plane_pb2.ChatMessage(role="user", content="Weather in Paris?")],
            sampling_params=generation_pb2.SamplingParams(
                temperature=0.7, max_tokens=max_tokens, seed=seed
            ),
            tool_use=tool_use(choice),
        )
    )
    sample, message = reply.samples[0], reply.messages[0]
    cut = sample.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    return len(sample.token_ids), len(message.tool_calls), cut


async def measure(seeds: int, max_tokens: int) -> list[str]:
    servers = {
        "vLLM's default": EngineServer(ServerOptions(engine=EngineOptions())),
        "disable_any_whitespace": EngineServer(
            ServerOptions(engine=EngineOptions(structured_outputs_config=COMPACT))
        ),
    }
    for server in servers.values():
        await server.start()
        await server.wait_ready()
    lines = [
        f"Seeded forced calls on the embedded model, temperature 0.7, max_tokens {max_tokens}, "
        f"{seeds} seeds per choice, both servers answering each seed in turn:",
        "",
        "| server | tool_choice | tokens per call | cut off | calls per answer |",
        "|---|---|---|---|---|",
    ]
    try:
        channels = {name: grpc.aio.insecure_channel(s.address) for name, s in servers.items()}
        stubs = {name: data_plane_pb2_grpc.DataPlaneStub(c) for name, c in channels.items()}
        for choice in ("required", "named"):
            totals: dict[str, list[tuple[int, int, bool]]] = {name: [] for name in servers}
            for seed in range(seeds):
                for name, stub in stubs.items():
                    totals[name].append(await answer(stub, choice, seed, max_tokens))
            for name, answers in totals.items():
                tokens = sum(t for t, _, _ in answers)
                calls = sum(c for _, c, _ in answers)
                cut = sum(1 for _, _, c in answers if c)
                per_call = f"{tokens / calls:.1f}" if calls else "no call"
                lines.append(
                    f"| {name} | {choice} | {per_call} | {cut}/{len(answers)} | "
                    f"{calls / len(answers):.2f} |"
                )
        for channel in channels.values():
            await channel.close()
    finally:
        for server in servers.values():
            await server.drain(grace=1)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=120)
    add_output_argument(parser, "serving.md")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    lines = asyncio.run(measure(args.seeds, args.max_tokens))
    write_report(args.output, lines, "forced-call-whitespace")


if __name__ == "__main__":
    main()
