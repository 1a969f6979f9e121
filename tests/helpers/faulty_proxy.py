"""A gRPC proxy in front of one real engine server that can fail a chosen ControlPlane method
once: for tests whose subject is how a client survives a failing server (the server behind it
is real, and so is every call the proxy lets through).

Faults: ``before`` answers UNAVAILABLE without forwarding (the server never saw the call);
``after`` forwards the call, then answers UNAVAILABLE (the server did the work, the answer was
lost); ``midway`` (client streams) forwards half of the messages, then cuts the call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from skyrl_grpc.names import CONTROL_PLANE, CONTROL_PLANE_SERVICE


@dataclass
class Fault:
    method: str  # e.g. "FinishWeightUpdate"
    when: str  # "before", "after" or "midway"


class FaultyProxy(grpc.GenericRpcHandler):
    def __init__(self, target: str) -> None:
        self.target = target
        self.fault: Fault | None = None
        self.faults_injected: list[str] = []
        self._channel = grpc.aio.insecure_channel(target)
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((self,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FaultyProxy:
        await self._server.start()
        return self

    async def stop(self) -> None:
        await self._server.stop(0)
        await self._channel.close()

    def _take(self, method: str, when: str) -> bool:
        if self.fault is not None and self.fault.method == method and self.fault.when == when:
            self.fault = None
            self.faults_injected.append(f"{method}:{when}")
            return True
        return False

    async def _fail(self, context: Any, method: str) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"injected fault in {method}")

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        path = details.method
        if not path.startswith(f"/{CONTROL_PLANE}/"):
            return None
        name = path.rsplit("/", 1)[1]
        method = CONTROL_PLANE_SERVICE.methods_by_name[name]

        async def unary(request: bytes, context: Any) -> bytes:
            if self._take(name, "before"):
                await self._fail(context, name)
            forward: Any = self._channel.unary_unary(path)
            response: bytes = await forward(
                request, metadata=tuple(context.invocation_metadata() or ())
            )
            if self._take(name, "after"):
                await self._fail(context, name)
            return response

        async def client_stream(requests: AsyncIterator[bytes], context: Any) -> bytes:
            if self._take(name, "before"):
                await self._fail(context, name)
            cut = self._take(name, "midway")
            forwarded = 0

            async def relay() -> AsyncIterator[bytes]:
                nonlocal forwarded
                async for message in requests:
                    if cut and forwarded >= 3:
                        return  # the caller's stream stops here, as if the link broke
                    forwarded += 1
                    yield message

            forward: Any = self._channel.stream_unary(path)
            call = forward(relay())
            if cut:
                # Let the server see a stream that ends early, then report the link lost.
                try:
                    await call
                except grpc.aio.AioRpcError:
                    pass
                await self._fail(context, name)
            response: bytes = await call
            if self._take(name, "after"):
                await self._fail(context, name)
            return response

        if method.client_streaming:
            return grpc.stream_unary_rpc_method_handler(client_stream)
        return grpc.unary_unary_rpc_method_handler(unary)
