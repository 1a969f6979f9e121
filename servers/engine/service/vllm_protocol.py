"""vLLM's own gRPC protocol on this server, beside this stack's: ``vllm.grpc.engine.VllmEngine``
(smg-grpc-proto), the service ``vllm serve --grpc`` offers and SMG, the Rust gateway, drives
(Generate as a stream of token ids, Abort, HealthCheck, GetModelInfo, GetServerInfo, GetLoads,
GetTokenizer, SubscribeKvEvents, ...).

Served by vLLM's own servicer (smg-grpc-servicer's ``VllmEngineServicer``), not a copy of it,
over the same engine as the DataPlane, each of its calls run on the engine's loop beside
``AsyncLLM`` as in vLLM's own server (``vllm_adapter.engine_client_view``): its conversion of
each step's outputs to messages too, off the gRPC loop. So its requests share the scheduler, the
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


class _Aborted(Exception):
    """vLLM's servicer ended a call (``context.abort``) on the engine's loop."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _ContextThere:
    """The call's context as vLLM's servicer uses it, on the engine's loop: what it reads was
    read here first; its ``abort`` ends the servicer's work there, and the call here with the
    same status (``_Aborted``)."""

    def __init__(self, context: Context) -> None:
        self._metadata = context.invocation_metadata()
        remaining = context.time_remaining()
        self._deadline = None if remaining is None else time.monotonic() + remaining

    def invocation_metadata(self) -> Any:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


class VllmEngineService:
    """Builds vLLM's servicer over the engine's ``AsyncLLM`` once the engine serves and runs
    each call of it on the engine's loop, where ``AsyncLLM`` runs (as in vLLM's own server);
    ``engine`` (the adapter's ``VllmEngine``) raises UNAVAILABLE (``ServingState.parts``)
    until then."""

    def __init__(self, engine: Callable[[], Any]) -> None:
        self._engine = engine
        self._started = time.time()
        self._serving: Any = None  # the engine the servicer was built over
        self._servicer: Any = None
        self._view: Any = None
        # Generate calls taken over this protocol (which server a gateway sent a request to).
        self.generate_calls = 0

    def _current(self) -> tuple[Any, Any]:
        engine = self._engine()  # UNAVAILABLE while starting, draining or dead
        if self._servicer is None or engine is not self._serving:
            from smg_grpc_servicer.vllm.servicer import VllmEngineServicer

            self._serving, self._view = engine, engine.client_view()
            self._servicer = VllmEngineServicer(self._view.llm, self._started)
        return self._servicer, self._view

    async def _method(self, name: str, context: Context) -> tuple[Any, Any]:
        """vLLM's servicer's method ``name`` and the engine's view; UNIMPLEMENTED where the
        installed servicer leaves it to the generated base (a newer protocol's method)."""
        servicer, view = self._current()
        base = getattr(vllm_engine_pb2_grpc.VllmEngineServicer, name, None)
        if getattr(type(servicer), name, None) is base:
            message = f"{VLLM_ENGINE}/{name}: the installed smg-grpc-servicer does not serve it"
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)
        return getattr(servicer, name), view

    async def unary(self, name: str, request: Any, context: Context) -> Any:
        method, view = await self._method(name, context)
        try:
            return await view.call(method(request, _ContextThere(context)))
        except _Aborted as aborted:
            await context.abort(aborted.code, aborted.details)

    async def streaming(self, name: str, request: Any, context: Context) -> AsyncIterator[Any]:
        method, view = await self._method(name, context)
        if name == "Generate":
            self.generate_calls += 1
        there = _ContextThere(context)
        try:
            async for response in view.stream(lambda: method(request, there)):
                yield response
        except _Aborted as aborted:
            await context.abort(aborted.code, aborted.details)


def _unary(name: str, service: VllmEngineService) -> Callable[..., Any]:
    async def call(request: Any, context: Context) -> Any:
        return await service.unary(name, request, context)

    return call


def _streaming(name: str, service: VllmEngineService) -> Callable[..., Any]:
    async def call(request: Any, context: Context) -> AsyncIterator[Any]:
        async for response in service.streaming(name, request, context):
            yield response

    return call


def add_vllm_engine(engine: Callable[[], Any], server: grpc.aio.Server) -> VllmEngineService:
    """Serves ``VllmEngine`` on ``server``: every method of the protocol's descriptor, each
    handed to vLLM's servicer (``VllmEngineService._method``)."""
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
