"""The engine server process: DataPlane + ControlPlane over one vLLM engine, with health and
reflection.

Lifecycle (each step is visible in ``grpc.health.v1``):
1. the gRPC port opens at once; liveness (service ``""``) is SERVING, the DataPlane and
   ControlPlane services are NOT_SERVING and their calls answer UNAVAILABLE;
2. the engine starts in the background; when it is up both services turn SERVING;
3. on SIGTERM (or ``drain()``), every service turns NOT_SERVING first (routers stop sending),
   in-flight calls get ``drain_grace_seconds`` to finish, then the engine shuts down.

Run: ``skyrl-grpc-server --port 50051`` or ``python -m servers.engine_server``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from skyrl_grpc.host_memory import keep_freed_memory
from skyrl_grpc.v1 import (
    control_plane_pb2,
    data_plane_pb2,
    data_plane_pb2_grpc,
)

from .control_plane import ControlPlaneServicer, add_control_plane
from .data_plane import DataPlaneServicer
from .engine import EngineOptions, VllmEngine
from .interceptors import BearerTokenInterceptor, ErrorMappingInterceptor
from .lifecycle import (
    ServerTls,
    add_tls_arguments,
    announce,
    bind,
    configure_logging,
    grpc_server_options,
    tls_from_args,
)
from .serving_state import ServingState

log = logging.getLogger(__name__)

DATA_PLANE = data_plane_pb2.DESCRIPTOR.services_by_name["DataPlane"].full_name
CONTROL_PLANE = control_plane_pb2.DESCRIPTOR.services_by_name["ControlPlane"].full_name
MiB = 1 << 20


@dataclass
class ServerOptions:
    """How to run one engine server."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (see EngineServer.port)
    engine: EngineOptions = field(default_factory=EngineOptions)
    drain_grace_seconds: float = 10.0
    # Weight chunks and long prompts are the largest messages; anything above this limit is
    # refused with RESOURCE_EXHAUSTED before it is decoded.
    max_message_bytes: int = 64 * MiB
    # Bearer tokens: when set, the service answers UNAUTHENTICATED without it.
    control_token: str | None = None
    data_token: str | None = None
    tls: ServerTls | None = None
    # Keep freed host memory for reuse (skyrl_grpc.host_memory): weight updates then stop
    # page-faulting through fresh memory, at the price of resident memory staying at its peak.
    keep_freed_memory: bool = True


class EngineServer:
    """Builds and runs the server; ``start()`` returns once the port is open."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.state: ServingState[VllmEngine] = ServingState()
        self.health = health.aio.HealthServicer()
        tokens = {CONTROL_PLANE: options.control_token or "", DATA_PLANE: options.data_token or ""}
        self.server = grpc.aio.server(
            interceptors=[BearerTokenInterceptor(tokens), ErrorMappingInterceptor()],
            options=grpc_server_options(options.max_message_bytes),
        )
        self.port = 0
        self._engine_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def start(self) -> None:
        data_plane_pb2_grpc.add_DataPlaneServicer_to_server(
            DataPlaneServicer(self.state), self.server
        )
        add_control_plane(ControlPlaneServicer(self.state), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [DATA_PLANE, CONTROL_PLANE, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        for service in (DATA_PLANE, CONTROL_PLANE):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = bind(self.server, f"{self.options.host}:{self.options.port}", self.options.tls)
        await self.server.start()
        log.info("listening on %s; starting the engine", self.address)
        self._engine_task = asyncio.create_task(self._start_engine())

    async def _start_engine(self) -> None:
        if self.options.keep_freed_memory:  # before vLLM starts its engine-core process
            keep_freed_memory()
        try:
            engine = await VllmEngine.start(self.options.engine)
        except Exception:
            log.exception("the engine failed to start")
            await self.drain(grace=0)
            raise
        self.state.set_ready(engine)
        for service in (DATA_PLANE, CONTROL_PLANE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("engine ready: %s serving %s", self.address, engine.served_model_name)

    async def wait_ready(self) -> VllmEngine:
        """Waits for the engine; raises if it failed to start."""
        assert self._engine_task is not None, "start() first"
        await asyncio.shield(self._engine_task)
        return self.state.engine()

    async def drain(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, then let in-flight calls finish within ``grace``, then stop."""
        if self.state.draining:
            await self._stopped.wait()
            return
        self.state.draining = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.options.drain_grace_seconds if grace is None else grace)
        if self._engine_task is not None and not self._engine_task.done():
            self._engine_task.cancel()
        engine = self.state._engine
        if engine is not None:
            await engine.shutdown()
        self._stopped.set()
        log.info("stopped %s", self.address)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that starts engines."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, help="model directory (default: embedded tiny model)"
    )
    group.add_argument("--served-model-name", default=None)
    group.add_argument("--dtype", default="auto")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--tensor-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-parallel-size", type=int, default=1)
    group.add_argument("--kv-cache-gib", type=float, default=1.0, help="CPU: KV cache size in GiB")
    group.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="CPU: model threads (default: 1 for the embedded tiny model, else vLLM's binding)",
    )
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--no-prefix-caching", action="store_true")


def engine_options_from_args(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        kv_cache_gib=args.kv_cache_gib,
        cpu_threads=args.cpu_threads,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skyrl-grpc-server", description="Serve one vLLM engine over gRPC."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--drain-grace-seconds", type=float, default=10.0)
    parser.add_argument("--max-message-mib", type=int, default=64)
    parser.add_argument(
        "--return-freed-memory",
        action="store_true",
        help="let the C library unmap freed buffers (lower resident memory, slower weight "
        "updates; by default freed memory is kept for reuse)",
    )
    parser.add_argument(
        "--control-token",
        default=os.environ.get("SKYRL_CONTROL_TOKEN"),
        help="require this bearer token on ControlPlane (default: $SKYRL_CONTROL_TOKEN)",
    )
    parser.add_argument(
        "--data-token",
        default=os.environ.get("SKYRL_DATA_TOKEN"),
        help="require this bearer token on DataPlane (default: $SKYRL_DATA_TOKEN)",
    )
    add_tls_arguments(parser)
    add_engine_arguments(parser)
    return parser


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        host=args.host,
        port=args.port,
        engine=engine_options_from_args(args),
        drain_grace_seconds=args.drain_grace_seconds,
        max_message_bytes=args.max_message_mib * MiB,
        control_token=args.control_token,
        data_token=args.data_token,
        tls=tls_from_args(args),
        keep_freed_memory=not args.return_freed_memory,
    )


async def serve(options: ServerOptions) -> None:
    server = EngineServer(options)
    await server.start()
    announce("listening", address=server.address)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain()))
    try:
        await server.wait_ready()
        announce("ready", address=server.address)
    except Exception:
        announce("failed", address=server.address)
        raise
    await server.wait_stopped()
    announce("stopped", address=server.address)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging()
    asyncio.run(serve(options_from_args(args)))


if __name__ == "__main__":
    main()
