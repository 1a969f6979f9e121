"""Server interceptors: cross-cutting concerns kept out of the handlers.

``ErrorMappingInterceptor`` is the single place where exceptions become gRPC statuses; handlers
just raise ``skyrl_grpc.errors`` exceptions.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from skyrl_grpc.errors import SkyrlError

log = logging.getLogger(__name__)

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


async def _abort_for(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, SkyrlError):
        await context.abort(exc.code, str(exc))
    log.exception("unexpected error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see server log")


def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await inner_uu(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort_for(exc, context, method)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream and not inspect.isasyncgenfunction(handler.unary_stream):
        # Streams written with context.write (grpc's own health Watch): a coroutine.
        inner_uw = handler.unary_stream

        async def unary_write(request: Any, context: grpc.aio.ServicerContext) -> None:
            try:
                await inner_uw(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort_for(exc, context, method)

        return grpc.unary_stream_rpc_method_handler(
            unary_write, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            try:
                async for item in inner_us(request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort_for(exc, context, method)

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary:
        inner_su = handler.stream_unary

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await inner_su(requests, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort_for(exc, context, method)

        return grpc.stream_unary_rpc_method_handler(
            stream_unary, handler.request_deserializer, handler.response_serializer
        )
    return handler  # stream_stream: none in our services (health Watch is unary_stream)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps ``SkyrlError`` to its status code and anything unexpected to INTERNAL.

    ``services`` limits it to those services' methods (all methods when None).
    """

    def __init__(self, services: list[str] | None = None) -> None:
        self._prefixes = None if services is None else tuple(f"/{s}/" for s in services)

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or (
            self._prefixes is not None and not method.startswith(self._prefixes)
        ):
            return handler
        return _wrap(handler, method)
