"""Server interceptors: cross-cutting concerns kept out of the handlers.

``ErrorMappingInterceptor`` is the single place where exceptions become gRPC statuses; handlers
just raise ``skyrl_grpc.errors`` exceptions. ``BearerTokenInterceptor`` guards services that
were given a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, NoReturn, Protocol, TypeAlias

import grpc

from servers.common.early_answer import read_rest
from servers.common.grpc_types import Context, Handler
from skyrl_grpc import tracing
from skyrl_grpc.errors import InvalidArgument, ResourceExhausted, SkyrlError
from skyrl_grpc.metadata import AUTHORIZATION
from skyrl_grpc.names import GENERATE_MULTIPLEX

log = logging.getLogger(__name__)

# What an interceptor calls to get the next handler of the chain (grpc names it "continuation").
NextHandler: TypeAlias = Callable[[grpc.HandlerCallDetails], Awaitable["Handler | None"]]


def status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """``exc``'s status: a ``SkyrlError``'s code and message, or INTERNAL with a generic
    message for anything unexpected (its traceback goes to the log, not the wire). The one
    mapping every handler's errors go through, the push socket's too."""
    if isinstance(exc, SkyrlError):
        return exc.code, str(exc)
    log.error("unexpected error in %s", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}; see server log"


async def abort_with_status(exc: BaseException, context: Context, method: str) -> NoReturn:
    """Ends the call with ``exc``'s status (``status_of``)."""
    await context.abort(*status_of(exc, method))


class _Malformed:
    """Stands in for a request that was not decoded, so the handler can answer for it."""

    def __init__(
        self, reason: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    ) -> None:
        self.reason = reason
        self.code = code


# The most bytes a request of a method may have, and what a caller can do about it; None: no
# limit beyond the server's message size.
RequestSizeLimit = Callable[[str], "tuple[int, str] | None"]


def _lenient(
    deserializer: Any,
    method: str,
    size_limit: RequestSizeLimit | None,
    max_message_bytes: int | None,
) -> Any:
    if deserializer is None and size_limit is None and max_message_bytes is None:
        return None

    def decode(raw: bytes) -> Any:
        if max_message_bytes is not None and len(raw) > max_message_bytes:
            # gRPC read it (the server's receive limit has headroom) so that this refusal,
            # not gRPC's own, reaches the caller: it names the setting.
            return _Malformed(
                f"the message is {len(raw)} bytes, more than the {max_message_bytes} "
                f"--max-message-mib {max_message_bytes >> 20} allows: send smaller pieces, "
                "or raise --max-message-mib (and the clients' max_message_bytes)",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        limit = size_limit(method) if size_limit is not None else None
        if limit is not None and len(raw) > limit[0]:
            # Refused before decoding: parsing a request no valid one can be as large as
            # costs seconds of the loop every other call shares.
            return _Malformed(f"the request is {len(raw)} bytes, more than {limit[1]}")
        if deserializer is None:  # a handler of raw bytes (PushWeights)
            return raw
        try:
            return deserializer(raw)
        except Exception as error:
            return _Malformed(f"the request is not a valid message for {method}: {error}")

    return decode


async def _reject_malformed(request: Any, context: Context, method: str) -> None:
    if isinstance(request, _Malformed):
        await context.abort(request.code, request.reason)


async def _checked(requests: Any, method: str) -> AsyncIterator[Any]:
    # Raised, not aborted: the handler consuming the stream must see it to undo its work.
    async for request in requests:
        if isinstance(request, _Malformed):
            too_large = request.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            refusal = ResourceExhausted if too_large else InvalidArgument
            raise refusal(f"a message of the stream: {request.reason}")
        yield request


class CallCounter:
    """Counts the calls in progress, so a draining server waits for real work only (not for
    long-lived watch streams, which would hold every drain for its whole grace)."""

    def __init__(self) -> None:
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.active += 1
        self._idle.clear()

    def end(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float | None) -> bool:
        """True once no counted call is in progress; False if ``timeout`` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


class _NoCounter(CallCounter):
    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass


_NOT_COUNTED = _NoCounter()


class CallObserver(Protocol):
    """What watches every call a server handles (``grpc_metrics.GrpcServerMetrics``): each
    call's start, and its end with its status and duration. ``kind``: unary, server_stream,
    client_stream or bidi_stream."""

    def started(self, method: str, kind: str) -> None: ...

    def handled(self, method: str, kind: str, code: grpc.StatusCode, seconds: float) -> None: ...


def _aborted_code(context: Context) -> grpc.StatusCode:
    code = context.code() if hasattr(context, "code") else None
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


@contextlib.asynccontextmanager
async def _guarded(
    context: Context,
    method: str,
    counter: CallCounter,
    upload: AsyncIterator[Any] | None = None,
    observer: CallObserver | None = None,
    kind: str = "unary",
) -> AsyncIterator[None]:
    """A handler's call, counted while it runs, its errors ended as their statuses: the one
    rule of every method shape. ``upload``: a client-streaming call's requests, read to their
    end before an error is answered (``early_answer``: a caller still sending would otherwise
    see a broken connection instead of the status). ``observer`` sees it start and end."""
    counter.begin()
    started = time.perf_counter()
    code = grpc.StatusCode.OK
    if observer is not None:
        observer.started(method, kind)
    # Tracing on: the call's span, current while its handler runs (off: nothing at all).
    # Spans for the planes' calls only (not health or status watches, open for hours, nor a
    # router's multiplexed call: its requests carry their own trace context).
    traced = (
        tracing.server_span(method, context.invocation_metadata())
        if tracing.enabled() and counter is not _NOT_COUNTED and method != GENERATE_MULTIPLEX
        else contextlib.nullcontext()
    )
    try:
        with traced:
            yield
    except grpc.aio.AbortError:
        code = _aborted_code(context)
        raise
    except asyncio.CancelledError:
        code = grpc.StatusCode.CANCELLED
        raise
    except Exception as exc:
        code = exc.code if isinstance(exc, SkyrlError) else grpc.StatusCode.INTERNAL
        if upload is not None:
            await read_rest(upload)
        await abort_with_status(exc, context, method)
    finally:
        counter.end()
        if observer is not None:
            observer.handled(method, kind, code, time.perf_counter() - started)


def _wrap(
    handler: Handler,
    method: str,
    counter: CallCounter,
    size_limit: RequestSizeLimit | None,
    max_message_bytes: int | None,
    observer: CallObserver | None = None,
) -> Handler:
    decode = _lenient(handler.request_deserializer, method, size_limit, max_message_bytes)
    serialize = handler.response_serializer
    # grpc's stubs type handler behaviours as synchronous; on an asyncio server they are
    # coroutine and async generator functions.
    behaviours: Any = handler
    if handler.unary_unary:
        inner_uu = behaviours.unary_unary

        async def unary_unary(request: Any, context: Context) -> Any:
            await _reject_malformed(request, context, method)
            async with _guarded(context, method, counter, None, observer, "unary"):
                return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, decode, serialize)
    if handler.unary_stream and not inspect.isasyncgenfunction(handler.unary_stream):
        # Streams written with context.write (grpc's own health Watch): a coroutine.
        inner_uw = behaviours.unary_stream

        async def unary_write(request: Any, context: Context) -> None:
            await _reject_malformed(request, context, method)
            async with _guarded(context, method, counter, None, observer, "server_stream"):
                await inner_uw(request, context)

        return grpc.unary_stream_rpc_method_handler(unary_write, decode, serialize)
    if handler.unary_stream:
        inner_us = behaviours.unary_stream

        async def unary_stream(request: Any, context: Context) -> AsyncIterator[Any]:
            await _reject_malformed(request, context, method)
            async with _guarded(context, method, counter, None, observer, "server_stream"):
                async for item in inner_us(request, context):
                    yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, decode, serialize)
    if handler.stream_unary:
        inner_su = behaviours.stream_unary

        async def stream_unary(requests: Any, context: Context) -> Any:
            async with _guarded(context, method, counter, requests, observer, "client_stream"):
                return await inner_su(_checked(requests, method), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, decode, serialize)
    if handler.stream_stream:
        inner_ss = behaviours.stream_stream

        async def stream_stream(requests: Any, context: Context) -> AsyncIterator[Any]:
            async with _guarded(context, method, counter, None, observer, "bidi_stream"):
                async for item in inner_ss(_checked(requests, method), context):
                    yield item

        return grpc.stream_stream_rpc_method_handler(stream_stream, decode, serialize)
    return handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps ``SkyrlError`` to its status code and anything unexpected to INTERNAL.

    ``services`` limits it to those services' methods (all methods when None). Calls of
    ``counted_services`` are counted in ``counter`` while they run; ``observer`` sees every
    call it handles start and end (the server's gRPC metrics).
    """

    def __init__(
        self,
        services: list[str] | None = None,
        *,
        counter: CallCounter | None = None,
        counted_services: tuple[str, ...] = (),
        size_limit: RequestSizeLimit | None = None,
        max_message_bytes: int | None = None,
        observer: CallObserver | None = None,
    ) -> None:
        self._observer = observer
        self._prefixes = None if services is None else tuple(f"/{s}/" for s in services)
        self._counter = counter
        self._counted = tuple(f"/{s}/" for s in counted_services)
        self._size_limit = size_limit
        # Refused by name above this (a server whose gRPC receive limit has headroom).
        self._max_message_bytes = max_message_bytes

    async def intercept_service(
        self, continuation: NextHandler, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or (
            self._prefixes is not None and not method.startswith(self._prefixes)
        ):
            return handler
        counter = self._counter
        if counter is None or not method.startswith(self._counted):
            counter = _NOT_COUNTED
        return _wrap(
            handler, method, counter, self._size_limit, self._max_message_bytes, self._observer
        )


def _rejecting_handler(handler: Handler, message: str) -> Handler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""

    async def reject(request: Any, context: Context) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def reject_upload(requests: AsyncIterator[bytes], context: Context) -> Any:
        # An upload (weights, an adapter) still being sent when the status arrives ends at
        # its caller as grpc's INTERNAL "Internal error from Core", a broken connection,
        # instead of this status: read it first (left undecoded: nobody will use it).
        await read_rest(requests)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def reject_stream(request: Any, context: Context) -> AsyncIterator[Any]:
        # Not for a stream of requests too: a long-lived one (GenerateMultiplex) never ends,
        # and its caller settles that status with a plain call (skyrl_grpc/multiplex.py).
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    deserialize, serialize = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(reject, deserialize, serialize)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(reject_stream, deserialize, serialize)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(reject_upload, None, serialize)
    return grpc.stream_stream_rpc_method_handler(reject_stream, deserialize, serialize)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on the methods of the given services.

    ``tokens`` maps a full service name to its token. Tokens are compared in constant time;
    services not listed (health, reflection) stay open so probes and grpcurl discovery work.
    """

    def __init__(self, tokens: dict[str, str], open_methods: Iterable[str] = ()) -> None:
        self._tokens = {
            f"/{service}/": token.encode() for service, token in tokens.items() if token
        }
        # Methods of those services that stay open (read-only views, like health).
        self._open = frozenset(open_methods)

    async def intercept_service(
        self, continuation: NextHandler, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        method = handler_call_details.method
        expected = next(
            (t for prefix, t in self._tokens.items() if method.startswith(prefix)), None
        )
        handler = await continuation(handler_call_details)
        if expected is None or handler is None or method in self._open:
            return handler
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTHORIZATION and isinstance(value, str) and value.startswith("Bearer "):
                presented = value[len("Bearer ") :].encode()
        if hmac.compare_digest(presented, expected):
            return handler
        service = method.split("/")[1]
        reason = "missing" if not presented else "wrong"
        return _rejecting_handler(
            handler,
            f"{reason} bearer token for {service}: send metadata 'authorization: Bearer <token>' "
            "with the token this server was started with",
        )
