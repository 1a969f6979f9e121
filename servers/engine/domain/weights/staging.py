"""The state of one open weight update (``OpenUpdate``), and the pipeline that hands an
in-band stream's bytes to the workers in batches, one batch in flight while the next arrives
(``StagingPipeline``): both driven by ``transaction``."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from servers.engine.domain.weights.relay_role import RelayRole, check_sender
from servers.engine.transfer.protocol import StagedParameter
from skyrl_grpc.errors import FailedPrecondition, InvalidArgument, PermissionDenied

log = logging.getLogger(__name__)


@dataclass
class OpenUpdate:
    """The update in progress: who opened it, for which version, and its lease."""

    owner: str
    target_version: int  # 0: named at FinishWeightUpdate
    allow_same_version: bool
    lease_seconds: float
    opened: float = field(default_factory=time.monotonic)
    last_call: float = field(default_factory=time.monotonic)
    parameters_staged: int = 0
    bytes_received: int = 0
    # Whether anything staged holds a NaN or infinity (only possible when they are allowed).
    non_finite: bool = False
    # What a push socket connection (or a relayed stream) presents to stream into this
    # update, and no other: the trainer's choice, or the server's.
    ticket: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    # This server's place in the update's relay plan (None: the trainer streams to it).
    relay: RelayRole | None = None
    # Called once when the update closes (committed, cancelled, expired, replaced): what the
    # update held open beside it (a relay's connections to the next servers) is let go.
    on_close: list[Callable[[], None]] = field(default_factory=list)
    # In-band streams being staged into it now, and the parameters their current manifests
    # list (a parameter is staged by one stream at a time).
    streams: int = 0
    arriving: set[str] = field(default_factory=set)

    def claim(self, names: Iterable[str]) -> set[str]:
        """Marks a manifest's parameters as arriving; refuses one another stream is staging."""
        claimed = set(names)
        taken = sorted(claimed & self.arriving)
        if taken:
            raise InvalidArgument(
                f"{taken[0]} is already arriving in another stream of this update: send each "
                "parameter in one stream at a time"
            )
        self.arriving |= claimed
        return claimed

    def release(self, names: set[str]) -> None:
        self.arriving -= names

    def check_ticket(self, ticket: bytes | None) -> None:
        """Raises unless ``ticket`` is this update's (None: a gRPC call, which its channel's
        credentials authorise)."""
        if ticket is not None and not hmac.compare_digest(ticket, self.ticket):
            raise FailedPrecondition(
                "this push socket's ticket is not the open update's: the update it was given "
                "for ended (finished, cancelled, expired or replaced); start another"
            )

    def check_sender(
        self, ticket: bytes | None, relayed_from: str, tree: int | None = None
    ) -> None:
        """Raises unless a stream presenting ``ticket``, forwarded by ``relayed_from`` ("":
        the trainer) down relay tree ``tree`` (None: none named), may stream into this update
        (``relay_role.check_sender``)."""
        if relayed_from and (ticket is None or not hmac.compare_digest(ticket, self.ticket)):
            raise PermissionDenied(
                f"a stream relayed from {relayed_from} without the open update's ticket: "
                "refused, nothing staged"
            )
        self.check_ticket(ticket)
        check_sender(self.relay, relayed_from, tree)

    def closed(self) -> None:
        """The update closed: runs ``on_close`` (each once; a failing one is logged)."""
        callbacks, self.on_close = self.on_close, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("closing what a weight update held failed")

    def touch(self) -> None:
        self.last_call = time.monotonic()

    @property
    def idle_seconds(self) -> float:
        return time.monotonic() - self.last_call

    @property
    def age_seconds(self) -> float:
        return time.monotonic() - self.opened


class StagingPipeline:
    """Stages batches one after another with at most one in flight: ``send`` waits for the
    previous batch (raising its error) and starts the next; ``drain`` waits for the last and
    returns how many parameters were completed."""

    def __init__(self, stage: Callable[[list[StagedParameter]], Awaitable[int]]) -> None:
        self._stage = stage
        self._in_flight: asyncio.Future[int] | None = None
        self._staged = 0

    async def send(self, params: list[StagedParameter]) -> None:
        await self.drain()
        if params:
            self._in_flight = asyncio.ensure_future(self._stage(params))

    async def drain(self) -> int:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            self._staged += await in_flight
        return self._staged

    async def settle(self) -> None:
        """Waits for the batch in flight, ignoring how it ended (the update is abandoned and
        its staging dropped after it; the workers must not be mid-copy then)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            await asyncio.gather(in_flight, return_exceptions=True)


def staging_batches(params: list[StagedParameter], batch_bytes: int) -> list[list[StagedParameter]]:
    """Consecutive runs of parameters of about ``batch_bytes`` each (one worker call each):
    large enough to amortise a call, small enough not to hold a second copy of everything."""
    batches: list[list[StagedParameter]] = []
    batch: list[StagedParameter] = []
    size = 0
    for param in params:
        batch.append(param)
        size += sum(len(chunk) for chunk in param["chunks"])
        if size >= batch_bytes:
            batches.append(batch)
            batch, size = [], 0
    if batch:
        batches.append(batch)
    return batches
