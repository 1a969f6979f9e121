"""vLLM's own gRPC protocol on this server, beside this stack's: ``vllm.grpc.engine.VllmEngine``
(smg-grpc-proto), the service ``vllm serve --grpc`` offers and SMG, the Rust gateway, drives
(Generate as a stream of token ids, Abort, HealthCheck, GetModelInfo, GetServerInfo, GetLoads,
GetTokenizer, SubscribeKvEvents, ...).

Served by vLLM's own servicer (smg-grpc-servicer's ``VllmEngineServicer``), not a copy of it,
over the same engine as the DataPlane: the adapter's view of ``AsyncLLM`` runs its calls on the
engine's loop (``vllm_adapter.engine_client_view``). So its requests share the scheduler, the
prefix cache, the weights and their updates with this stack's own: a pause holds or aborts them
as vLLM's scheduler does the DataPlane's, a weight update swaps what they run on at the same
step, and the router's load view counts them. The server's interceptors apply to it as to every
service: the data plane's bearer token (``--data-token``), TLS, the error mapping, the gRPC
metrics and traces. Until the engine serves (and while the server drains) its calls answer
UNAVAILABLE as the DataPlane's do.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from servers.common.grpc_types import Context

# The service's full name, for health, reflection and the bearer token's table.
VLLM_ENGINE: str = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# Its methods a probe calls without the data token, as grpc.health.v1 is open.
VLLM_ENGINE_OPEN = (f"/{VLLM_ENGINE}/HealthCheck",)


class VllmEngineService:
    """Builds vLLM's servicer over the engine's client view once the engine serves, and hands
    each call to it; ``engine`` (the adapter's ``VllmEngine``) raises UNAVAILABLE
    (``ServingState.parts``) until then."""

    def __init__(self, engine: Callable[[], Any]) -> None:
        self._engine = engine
        self._started = time.time()
        self._serving: Any = None  # the engine the servicer was built over
        self._servicer: Any = None
        # Generate calls taken over this protocol (which server a gateway sent a request to).
        self.generate_calls = 0

    def servicer(self) -> Any:
        engine = self._engine()  # UNAVAILABLE while starting, draining or dead
        if self._servicer is None or engine is not self._serving:
            from smg_grpc_servicer.vllm.servicer import VllmEngineServicer

            self._serving = engine
            self._servicer = VllmEngineServicer(engine.client_view(), self._started)
        return self._servicer


def _unary(name: str, service: VllmEngineService) -> Callable[..., Any]:
    async def call(request: Any, context: Context) -> Any:
        return await getattr(service.servicer(), name)(request, context)

    return call


def _streaming(name: str, service: VllmEngineService) -> Callable[..., Any]:
    async def call(request: Any, context: Context) -> AsyncIterator[Any]:
        servicer = service.servicer()
        if name == "Generate":
            service.generate_calls += 1
        async for response in getattr(servicer, name)(request, context):
            yield response

    return call


def add_vllm_engine(engine: Callable[[], Any], server: grpc.aio.Server) -> VllmEngineService:
    """Serves ``VllmEngine`` on ``server``: every method of the protocol's descriptor, each
    handed to vLLM's servicer (a method the installed servicer lacks answers UNIMPLEMENTED,
    as grpc does for any method it has no handler for)."""
    service = VllmEngineService(engine)
    methods = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].methods

    class Front(vllm_engine_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
        pass

    front = Front()
    for method in methods:
        if method.client_streaming:
            continue  # the protocol has none; a later one gets grpc's UNIMPLEMENTED
        make = _streaming if method.server_streaming else _unary
        setattr(front, method.name, make(method.name, service))
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(front, server)
    return service
