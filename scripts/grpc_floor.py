"""The floor of an in-band weight stream through gRPC's Python runtime: the same chunks, with
nothing done to them.

An in-band update travels as a ``PushWeights`` stream: one message per 4 MiB chunk, each copied
by gRPC's Python runtime into and out of its own buffers on both sides (HTTP/2 framing, the
core's slices, a Python ``bytes`` per message received). A raw loopback socket (the benchmark's
TCP floor) pays none of that. This measures what it costs: a bare gRPC server in a fresh process,
with the engine servers' own options (``servers.common.listener.server_options``) and memory
policy (``keep_freed_memory``), takes a client-streaming call that carries every tensor's bytes,
made by the trainer client's own ``PushStream`` (a manifest, then CRC-32-checked chunks), and
only counts them; the client's channel has the trainer client's options. The seconds and each
side's CPU seconds (its process, read from the OS) are the best of ``rounds`` after a warm-up
round.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil

METHOD = "/bench.Floor/Push"
CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class GrpcFloor:
    seconds: float  # from the stream's first message until the server's answer
    server_cpu_seconds: float  # the receiving process's CPU over the stream
    client_cpu_seconds: float  # this process's CPU over the stream (serializing and sending)


def _serve(ready: Any) -> None:
    import grpc

    from servers.common.listener import server_options
    from skyrl_grpc.host_memory import keep_freed_memory

    keep_freed_memory()  # as an engine server does at start-up (its receive buffers are reused)

    async def push(requests: Any, context: Any) -> bytes:
        received = 0
        async for message in requests:
            received += len(message)
        return received.to_bytes(8, "little")

    async def run() -> None:
        server = grpc.aio.server(options=server_options())
        handler: Any = grpc.stream_unary_rpc_method_handler(push)  # messages stay raw bytes
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("bench.Floor", {"Push": handler})]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.put(port)
        await server.wait_for_termination()

    asyncio.run(run())


def _messages(tensors: list[tuple[str, Any]]) -> Iterator[bytes]:
    """The stream the trainer client sends for a full in-band update (its manifest, then every
    tensor's CRC-checked chunks), made as the client makes it: checksums included in the time."""
    from trainer_client.weights.weight_sending import PushStream, tensor_entries

    yield from PushStream(tensor_entries(tensors, with_checksums=False), CHUNK_BYTES)


def raw_grpc(tensors: list[tuple[str, Any]], rounds: int) -> GrpcFloor:
    """The best of ``rounds`` streams of every tensor's bytes to a bare gRPC server."""
    from scripts.bench_common import cpu_seconds  # not at the top: the server process skips it
    from skyrl_grpc.channels import open_channel

    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    server = context.Process(target=_serve, args=(ready,), daemon=True)
    server.start()
    try:
        port = ready.get(timeout=120)
        server_process = psutil.Process(server.pid)
        this_process = psutil.Process()

        async def streams() -> GrpcFloor:
            channel = open_channel(f"127.0.0.1:{port}")
            call: Any = channel.stream_unary(METHOD)
            best: GrpcFloor | None = None
            for round_index in range(rounds + 1):
                server_before = cpu_seconds(server_process)
                client_before = cpu_seconds(this_process)
                started = time.perf_counter()
                await call(_messages(tensors))
                measured = GrpcFloor(
                    time.perf_counter() - started,
                    cpu_seconds(server_process) - server_before,
                    cpu_seconds(this_process) - client_before,
                )
                if round_index and (best is None or measured.seconds < best.seconds):
                    best = measured
            await channel.close()
            assert best is not None
            return best

        return asyncio.run(streams())
    finally:
        server.kill()
        server.join()
