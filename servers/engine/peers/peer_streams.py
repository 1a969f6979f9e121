"""Weight streams between servers: the one path a server reads a stream of weight messages
through into its own open update, forwarding each message's bytes on first when it relays
(``stage_stream``: the trainer's and a relaying peer's streams, over the push socket or gRPC,
and a catch-up's ReadWeights stream from a peer alike), and how it reaches a peer
(``PeerAccess``: catch-up and relay call their peers the same way).

A relaying server forwards every message before it checks or stages it, so the hops pipeline;
it reads and forwards a stream to its end even when its own staging refused it, so each server
below answers for itself; then it waits for the servers it forwarded to and answers for its
whole subtree (``StreamOutcome``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc

from servers.engine.transfer.specs import Manifest
from skyrl_grpc.channels import open_channel
from skyrl_grpc.chunk_wire import WireChunk
from skyrl_grpc.metadata import bearer
from skyrl_grpc.tls import TlsConfig

Item = Manifest | WireChunk
T = TypeVar("T")


@dataclass(frozen=True)
class PeerAccess:
    """How this server calls its peers: their control token, TLS, message size."""

    token: str | None
    max_message_bytes: int
    tls: TlsConfig | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (bearer(self.token),) if self.token else ()

    def channel(self, peer: str) -> grpc.aio.Channel:
        return open_channel(peer, tls=self.tls, max_message_bytes=self.max_message_bytes)


@dataclass(frozen=True)
class Failure:
    """A server that did not stage a stream: its name in the relay plan, its status."""

    address: str
    code: grpc.StatusCode
    message: str


class Forwarding(Protocol):
    """One stream forwarded to the servers below (``relay.RelayStream``)."""

    async def forward(self, raw: bytes | memoryview) -> None: ...

    async def finish(self) -> list[Failure]: ...

    def abort(self) -> None: ...


@dataclass
class StreamOutcome:
    """What a stream came to: this server's own staging (``staged`` parameters, ``received``
    bytes, or ``error``), and every server below that did not stage it."""

    staged: int = 0
    received: int = 0
    error: BaseException | None = None
    below: list[Failure] = field(default_factory=list)


async def stage_stream(
    messages: AsyncIterator[tuple[bytes | memoryview | None, Item]],
    push: Callable[[AsyncIterator[Item]], Awaitable[tuple[int, int]]],
    forwarding: Forwarding | None = None,
) -> StreamOutcome:
    """Reads ``messages`` (each its raw bytes, for forwarding, and itself as the assembler
    takes it) into ``push`` (this server's update), forwarding each message's bytes first when
    ``forwarding``; when ``push`` refuses the stream the rest is still read and forwarded (not
    read without forwarding: the caller drops it). A stream that cannot be read to its end
    (the sender went away, a frame that is not a message) is raised, after the servers below
    saw their streams cut as this one was: none of them stages a stream cut short."""
    outcome = StreamOutcome()
    lost: list[BaseException] = []

    async def items() -> AsyncIterator[Item]:
        while True:
            try:
                raw, item = await anext(messages)
            except StopAsyncIteration:
                return
            except BaseException as error:
                lost.append(error)
                raise
            if forwarding is not None and raw is not None:
                await forwarding.forward(raw)
            yield item

    reading = items()
    try:
        try:
            outcome.staged, outcome.received = await push(reading)
        except Exception as error:
            if lost:
                raise
            outcome.error = error
            if forwarding is not None:
                async for _ in reading:  # the rest, forwarded: each server answers for itself
                    pass
    except BaseException:
        # The stream is lost here (its sender went away, or this call was cancelled): the
        # servers below see their streams cut, as this one did, and drop what they staged.
        if forwarding is not None:
            forwarding.abort()
        raise
    if forwarding is not None:
        outcome.below = await forwarding.finish()
    return outcome
