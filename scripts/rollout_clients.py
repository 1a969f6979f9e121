"""The clients of the rollout benchmark (``bench_rollout``) and of the per-step profile
(``profile_per_step``): one batch of prompts, all at once, through each way to get samples
out of one engine (this server's streams and batches, the trainer client, an OpenAI HTTP
server, vLLM's gRPC server, vLLM's ``AsyncLLM`` in a process of its own), each a
``RunBatch``: (samples, tokens, batch number) -> tokens generated.

Run as a module (``python -m scripts.rollout_clients``) it is that in-process worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

import grpc

from scripts.bench_common import ROOT
from skyrl_grpc.metadata import SESSION_ID
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from trainer_client import InferenceClient

PROMPT_TOKENS = 16


def prompt_for(sample: int, batch: int) -> list[int]:
    """The same prompts for every contender; distinct per sample and batch."""
    return [1] + [3 + (sample * 31 + batch * 17 + k * 7) % 2000 for k in range(PROMPT_TOKENS - 1)]


# One batch: (samples, tokens, batch number) -> tokens generated.
RunBatch = Callable[[int, int, int], Awaitable[int]]


class MessageCount:
    """Messages (or server-sent events) a stream client received, for those that count them
    (``bench_stream_messages``: tokens per message)."""

    def __init__(self) -> None:
        self.messages = 0


async def tokens_read(chunks: AsyncIterable[Any], counted: MessageCount | None) -> int:
    """The tokens of a stream's chunks, each chunk counted in ``counted`` (if given)."""
    count = 0
    async for chunk in chunks:
        count += len(chunk.token_ids)
        if counted is not None:
            counted.messages += 1
    return count


# -- the clients ----------------------------------------------------------------------------


def greedy(tokens: int, interval: int = 0) -> data_plane_pb2.GenerateStreamRequest:
    return data_plane_pb2.GenerateStreamRequest(
        sampling_params=gen.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
        stream_interval=interval,
    )


def grpc_streams(
    address: str, interval: int, sessions: bool, counted: MessageCount | None = None
) -> RunBatch:
    """A GenerateStream per prompt, all at once (``counted``: each message counted there)."""
    channel = grpc.aio.insecure_channel(address)
    stub = data_plane_pb2_grpc.DataPlaneStub(channel)

    async def run(samples: int, tokens: int, batch: int) -> int:
        async def one(sample: int) -> int:
            request = greedy(tokens, interval)
            request.prompt_token_ids.extend(prompt_for(sample, batch))
            metadata = ((SESSION_ID, f"rollout-{sample}"),) if sessions else ()
            return await tokens_read(stub.GenerateStream(request, metadata=metadata), counted)

        return sum(await asyncio.gather(*(one(s) for s in range(samples))))

    return run


def grpc_batch(address: str, interval: int) -> RunBatch:
    """The whole batch as one GenerateBatch call."""
    channel = grpc.aio.insecure_channel(address)
    stub = data_plane_pb2_grpc.DataPlaneStub(channel)

    async def run(samples: int, tokens: int, batch: int) -> int:
        requests = []
        for sample in range(samples):
            request = greedy(tokens, interval)
            request.prompt_token_ids.extend(prompt_for(sample, batch))
            requests.append(request)
        call = stub.GenerateBatch(
            data_plane_pb2.GenerateBatchRequest(
                requests=requests, session_ids=[f"rollout-{s}" for s in range(samples)]
            )
        )
        count = 0
        async for message in call:
            for chunk in message.chunks:
                count += len(chunk.token_ids)
            if message.errors:
                raise RuntimeError(f"batch errors: {message.errors}")
        return count

    return run


def trainer_client(router: str, servers: list[str], direct: bool) -> RunBatch:
    """What a trainer calls: ``InferenceClient.generate_batch``, an episode id per prompt."""
    client = InferenceClient(router, servers, direct=direct)

    async def run(samples: int, tokens: int, batch: int) -> int:
        results = await client.generate_batch(
            [prompt_for(s, batch) for s in range(samples)],
            {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True},
            session_ids=[f"rollout-{s}" for s in range(samples)],
        )
        return sum(len(r.token_ids) for r in results)

    return run


def client_streams(
    router: str,
    servers: list[str],
    multiplex: bool = True,
    counted: MessageCount | None = None,
    direct: bool = True,
) -> RunBatch:
    """The trainer client's ``stream`` per prompt, all at once, a message per engine step,
    straight to the server (``direct=False``: through the router; ``multiplex``: over one
    GenerateMultiplex call; else a GenerateStream call each). ``counted``: each chunk a stream
    reads counted there."""
    client = InferenceClient(router, servers, multiplex=multiplex, direct=direct)
    sampling = {"temperature": 0.0, "ignore_eos": True}

    async def run(samples: int, tokens: int, batch: int) -> int:
        async def one(sample: int) -> int:
            limited = {**sampling, "max_tokens": tokens}
            chunks = client.stream(prompt_for(sample, batch), limited, stream_interval=0)
            return await tokens_read(chunks, counted)

        return sum(await asyncio.gather(*(one(s) for s in range(samples))))

    return run


def http_streams(base_url: str, model: str, counted: MessageCount | None = None) -> RunBatch:
    """vLLM's OpenAI API: a streamed ``/v1/completions`` per prompt (token ids), all at once
    (``counted``: each event counted there)."""
    import aiohttp
    import orjson

    sessions: list[aiohttp.ClientSession] = []

    async def run(samples: int, tokens: int, batch: int) -> int:
        if not sessions:
            # Idle connections dropped before uvicorn's 5 s keep-alive ends them: a benchmark
            # that pauses the server (freezing it between rounds) never reuses a closing one.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
            timeout = aiohttp.ClientTimeout(total=None)
            sessions.append(aiohttp.ClientSession(connector=connector, timeout=timeout))
        session = sessions[0]

        async def one(sample: int) -> int:
            body = {
                "model": model, "prompt": prompt_for(sample, batch), "max_tokens": tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            }  # fmt: skip
            count = 0
            async with session.post(f"{base_url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        event = orjson.loads(line[6:])
                        count += len(event["choices"][0].get("token_ids") or ())
                        if counted is not None:
                            counted.messages += 1
            return count

        return sum(await asyncio.gather(*(one(s) for s in range(samples))))

    return run


def vllm_grpc_streams(address: str) -> RunBatch:
    """vLLM's gRPC server: a streamed Generate per prompt, all at once."""
    from smg_grpc_proto import vllm_engine_pb2 as pb
    from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.VllmEngineStub(channel)
    counter = iter(range(1 << 60))

    async def run(samples: int, tokens: int, batch: int) -> int:
        async def one(sample: int) -> int:
            request = pb.GenerateRequest(
                request_id=f"rollout-{next(counter)}",
                tokenized=pb.TokenizedInput(input_ids=prompt_for(sample, batch)),
                sampling_params=pb.SamplingParams(
                    temperature=0.0, max_tokens=tokens, ignore_eos=True
                ),
                stream=True,
            )
            count = 0
            async for response in stub.Generate(request):
                if response.HasField("chunk"):
                    count += len(response.chunk.token_ids)
            return count

        return sum(await asyncio.gather(*(one(s) for s in range(samples))))

    return run


# -- vLLM in-process ------------------------------------------------------------------------


class InProcess:
    """``AsyncLLM`` in a child process (``--in-process-worker``), built exactly as the engine
    server builds it (``engine_args.engine_arguments``), driven from its own event loop."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "scripts.rollout_clients"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            process_group=0,  # a group to signal, in this session (see LocalFleet._spawn)
        )
        self._expect("ready")

    def _expect(self, kind: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                message: dict[str, Any] = json.loads(line)
                if message.get("kind") == kind:
                    return message
        raise RuntimeError(f"the in-process worker exited before {kind!r}")

    async def run(self, samples: int, tokens: int, batch: int) -> int:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps([samples, tokens, batch]) + "\n")
        self.process.stdin.flush()
        return int((await asyncio.to_thread(self._expect, "result"))["tokens"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            os.killpg(self.process.pid, 18)  # SIGCONT: a frozen process cannot exit
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def in_process_worker() -> None:
    from servers.engine.options import EngineOptions, RequestLimits
    from servers.engine.vllm_adapter.engine_args import Platform, engine_arguments, resolved_model

    options = EngineOptions()
    arguments = engine_arguments(
        options, RequestLimits(), Platform(is_cpu=True), resolved_model(options)
    )
    os.environ.update(arguments.environment)  # before vLLM is imported, as the server does

    async def main() -> None:
        from vllm import SamplingParams, TokensPrompt
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**arguments.args))
        ids = iter(range(1 << 60))

        async def one(sample: int, tokens: int, batch: int) -> int:
            params = SamplingParams(
                temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False,
                output_kind=RequestOutputKind.DELTA,
            )  # fmt: skip
            prompt = TokensPrompt(prompt_token_ids=prompt_for(sample, batch))
            count = 0
            async for output in llm.generate(prompt, params, f"in-process-{next(ids)}"):
                count += len(output.outputs[0].token_ids)
            return count

        print(json.dumps({"kind": "ready"}), flush=True)
        while line := await asyncio.to_thread(sys.stdin.readline):
            samples, tokens, batch = json.loads(line)
            counts = await asyncio.gather(*(one(s, tokens, batch) for s in range(samples)))
            print(json.dumps({"kind": "result", "tokens": sum(counts)}), flush=True)
        llm.shutdown()

    asyncio.run(main())


if __name__ == "__main__":
    in_process_worker()
