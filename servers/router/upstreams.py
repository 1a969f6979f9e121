"""A call the router started on a backend, read as a stream of messages (``Upstream``), how
each kind is started (``Starter``), and what a generation stream's messages tell the metrics
(``StreamMeter``): the pieces ``proxy.Proxy.relay`` reads from."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from servers.router.backends import Backend
from servers.router.metrics import RouterMetrics
from skyrl_grpc.v1 import data_plane_pb2

Metadata = tuple[tuple[str, str | bytes], ...]


class Upstream(Protocol):
    """A call started on a backend, read as a stream of raw messages."""

    async def read(self) -> Any: ...  # a message, or grpc.aio.EOF

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...


class UnaryUpstream:
    """A unary call read as a stream of one message."""

    def __init__(self, call: grpc.aio.UnaryUnaryCall[bytes, bytes]) -> None:
        self._call = call
        self._read = False

    async def read(self) -> Any:
        if self._read:
            return grpc.aio.EOF
        self._read = True
        return await self._call

    def cancel(self) -> bool:
        return self._call.cancel()

    def done(self) -> bool:
        return self._call.done()


# Starts the call on a backend with the request to send there (the caller's, or a continuation).
Starter = Callable[[Backend, Any, Metadata, float | None], Upstream]


def start_unary(
    method: str, backend: Backend, request: bytes, metadata: Metadata, timeout: float | None
) -> Upstream:
    multicallable: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = backend.channel.unary_unary(
        method
    )
    return UnaryUpstream(multicallable(request, timeout=timeout, metadata=metadata))


def start_server_stream(
    method: str, backend: Backend, request: bytes, metadata: Metadata, timeout: float | None
) -> Upstream:
    multicallable: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = backend.channel.unary_stream(
        method
    )
    return multicallable(request, timeout=timeout, metadata=metadata)


class StreamMeter:
    """A generation stream's time to first tokens, gaps between messages (per token) and
    tokens, per worker. A message's tokens come from the upstream when it counted them
    (``tokens_read``: the multiplexed path parses its chunks anyway), else from the message."""

    def __init__(self, metrics: RouterMetrics, started: float) -> None:
        self._metrics = metrics
        self._started = started
        self._last: float | None = None

    def observe(self, worker: str, upstream: Upstream, message: Any) -> None:
        now = time.perf_counter()
        tokens = getattr(upstream, "tokens_read", None)
        if tokens is None and not isinstance(message, bytes):
            tokens = len(message.token_ids)
        if tokens is None:
            try:
                tokens = len(data_plane_pb2.GenerateStreamResponse.FromString(message).token_ids)
            except Exception:
                tokens = 0
        counted, ttft, itl = self._metrics.stream_series(worker)
        if tokens:
            counted.inc(tokens)
        if self._last is None:
            ttft.observe(now - self._started)
        elif tokens:
            itl.observe((now - self._last) / tokens)
        self._last = now
