"""The engine server process: DataPlane + ControlPlane over one vLLM engine, with health and
reflection.

Lifecycle (each step is visible in ``grpc.health.v1``):
1. the gRPC port opens at once; liveness (service ``""``) is SERVING, the DataPlane and
   ControlPlane services are NOT_SERVING and their calls answer UNAVAILABLE;
2. the engine starts in the background; when it is up both services turn SERVING;
3. on SIGTERM (or ``drain()``), every service turns NOT_SERVING first (routers stop sending),
   in-flight calls get ``drain_grace_seconds`` to finish, then the engine shuts down.

Run: ``skyrl-grpc-server --port 50051`` or ``python -m servers.engine``.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from skyrl_grpc.host_memory import keep_freed_memory
from skyrl_grpc.names import CONTROL_PLANE, DATA_PLANE
from skyrl_grpc.v1 import data_plane_pb2_grpc

from ..common.interceptors import BearerTokenInterceptor, ErrorMappingInterceptor
from ..common.listener import bind, server_options
from ..common.process import configure_logging, serve_until_stopped
from .control_plane import ControlPlaneServicer, add_control_plane
from .data_plane import DataPlaneServicer
from .options import ServerOptions, build_parser, options_from_args
from .serving_state import ServingState
from .vllm_engine import VllmEngine

log = logging.getLogger(__name__)


class EngineServer:
    """Builds and runs the server; ``start()`` returns once the port is open."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.state: ServingState[VllmEngine] = ServingState()
        self.health = health.aio.HealthServicer()
        tokens = {CONTROL_PLANE: options.control_token or "", DATA_PLANE: options.data_token or ""}
        self.server = grpc.aio.server(
            interceptors=[BearerTokenInterceptor(tokens), ErrorMappingInterceptor()],
            options=server_options(options.max_message_bytes),
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
        engine = self.state.started
        if engine is not None:
            await engine.shutdown()
        self._stopped.set()
        log.info("stopped %s", self.address)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(options: ServerOptions) -> None:
    server = EngineServer(options)
    await serve_until_stopped(server, server.drain)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging()
    asyncio.run(serve(options_from_args(args)))


if __name__ == "__main__":
    main()
