"""The demo behind the README's first command.

Starts an engine server on the embedded tiny model, then makes a round trip through every kind
of DataPlane call and a pause / resume on the ControlPlane, printing what came back.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc

from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import (
    control_plane_pb2_grpc,
    data_plane_pb2,
    data_plane_pb2_grpc,
    generation_pb2,
)

from .engine_server import EngineServer, ServerOptions


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=16)


async def _round_trip(max_tokens: int) -> None:
    started = time.perf_counter()
    server = EngineServer(ServerOptions())
    await server.start()
    print(f"engine server listening on {server.address}; starting vLLM ...", flush=True)
    await server.wait_ready()
    print(f"ready after {time.perf_counter() - started:.1f}s", flush=True)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            data = data_plane_pb2_grpc.DataPlaneStub(channel)
            control = control_plane_pb2_grpc.ControlPlaneStub(channel)
            info = await data.GetModelInfo(data_plane_pb2.GetModelInfoRequest())
            print(
                f"model {info.served_model_name}: vocab {info.vocab_size}, "
                f"context {info.max_context_length}"
            )
            prompt = await data.Tokenize(data_plane_pb2.TokenizeRequest(text="The trainer sends"))
            greedy = generation_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens)
            tokens: list[int] = []
            async for chunk in data.GenerateStream(
                data_plane_pb2.GenerateStreamRequest(
                    prompt_token_ids=prompt.token_ids, sampling_params=greedy
                )
            ):
                tokens.extend(chunk.token_ids)
            text = await data.Detokenize(data_plane_pb2.DetokenizeRequest(token_ids=tokens))
            print(f"streamed {len(tokens)} tokens: {list(tokens)}")
            print(f"decoded: {text.text!r}")
            chat = await data.Chat(
                data_plane_pb2.ChatRequest(
                    messages=[data_plane_pb2.ChatMessage(role="user", content="hello")],
                    sampling_params=greedy,
                )
            )
            print(f"chat reply: {chat.samples[0].text!r}")
            await control.Pause(cp.PauseRequest(mode=cp.PAUSE_MODE_KEEP))
            paused = await control.IsPaused(cp.IsPausedRequest())
            await control.Resume(cp.ResumeRequest())
            print(f"pause(KEEP) -> paused={paused.paused}; resumed")
    finally:
        await server.drain(grace=1)
    print("done")


def run_demo(args: argparse.Namespace) -> None:
    asyncio.run(_round_trip(args.max_tokens))
