"""The collective half of a server's weight-update transaction: joining the trainer's
process group (InitWeightTransfer) and receiving its broadcasts into the open update
(UpdateWeights). A part of ``transaction.WeightTransferManager``, which owns the state it uses
(the lock, the workers, the open update) and the in-band half."""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable

from servers.engine.domain.weights.staging import OpenUpdate
from servers.engine.transfer.assembly import (
    ParamLayout,
    PatchBaseMismatch,
    bucket_layout,
    bucket_patch_bases,
    check_patch_bases,
    non_finite_error,
)
from servers.engine.transfer.protocol import Bucket, Group, WorkerCalls
from servers.engine.transfer.specs import BucketSpec
from skyrl_grpc.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    SkyrlError,
    Unavailable,
)

log = logging.getLogger(__name__)


class CollectiveReceive(ABC):
    """InitWeightTransfer and UpdateWeights (a mixin of ``WeightTransferManager``, which
    provides what is declared here)."""

    _lock: asyncio.Lock
    _workers: WorkerCalls
    version: int
    group: Group | None
    allow_non_finite: bool

    @abstractmethod
    async def layout(self) -> dict[str, ParamLayout]: ...

    @abstractmethod
    def _require_open(self, what: str, ticket: bytes | None = None) -> OpenUpdate: ...

    @abstractmethod
    async def _abandon(self, pending: Awaitable[object] | None) -> None: ...

    @abstractmethod
    def _observed(self, phase: str, started: float, nbytes: int = 0) -> None: ...

    async def init(self, group: Group) -> None:
        """Joins the trainer's group, leaving a previous group first."""
        async with self._lock:
            if self.group is not None:
                await self._workers.leave_group()
                self.group = None
            started = time.monotonic()
            try:
                await self._workers.join_group(group)
            except Exception as exc:
                raise _transport_error(
                    "joining the weight-transfer group", exc, started, group["timeout_seconds"]
                ) from exc
            self.group = group

    async def update(self, bucket_specs: list[BucketSpec]) -> tuple[int, int]:
        async with self._lock:
            group = self.group
            if group is None:
                raise FailedPrecondition(
                    "UpdateWeights before InitWeightTransfer: join the trainer's process group "
                    "first (or push in-band with PushWeights)"
                )
            update = self._require_open("UpdateWeights")
            layout = await self.layout()
            # The trainer broadcasts regardless of an answer: a refused call still receives
            # (and drops) the bytes, so neither side hangs.
            empty = [Bucket(size=b.size_bytes, params=[]) for b in bucket_specs]
            try:
                buckets = [bucket_layout(b, layout) for b in bucket_specs]
            except SkyrlError:
                await self._abandon(self._workers.receive_buckets(empty, False))
                raise
            try:
                check_patch_bases(bucket_patch_bases(bucket_specs), self.version)
            except PatchBaseMismatch:
                await self._workers.receive_buckets(empty, False)
                raise  # nothing staged: the update stays open for the whole weights
            started = time.monotonic()
            try:
                results = await self._workers.receive_buckets(buckets, True)
            except Exception as exc:
                await self._abandon(None)
                await self._leave_broken_group()
                raise _transport_error(
                    "receiving weight buckets", exc, started, group["timeout_seconds"]
                ) from exc
            finally:
                update.touch()
            mismatches = sorted({m for r in results for m in r["mismatches"]})
            if mismatches:
                await self._abandon(None)
                raise DataLoss(
                    f"checksum mismatch for {', '.join(mismatches)}: update rejected, the serving "
                    "weights are unchanged; start a new update"
                )
            invalid = sorted({i for r in results for i in r["invalid"]})
            if invalid:
                await self._abandon(None)
                raise InvalidArgument(
                    f"{'; '.join(invalid[:3])}; update rejected, the serving weights are unchanged"
                )
            non_finite = [n for r in results for n in r["non_finite"]]
            if non_finite and not self.allow_non_finite:
                await self._abandon(None)
                error = non_finite_error(non_finite[0])
                raise InvalidArgument(
                    f"{error}; update rejected, the serving weights are unchanged"
                )
            update.non_finite = update.non_finite or bool(non_finite)
            update.parameters_staged += results[0]["params"]
            update.bytes_received += results[0]["bytes"]
            self._observed("transfer", started, results[0]["bytes"])
            return results[0]["params"], results[0]["bytes"]

    async def _leave_broken_group(self) -> None:
        """A failed collective leaves the group unusable: leave it, so a new
        InitWeightTransfer starts clean."""
        self.group = None
        try:
            await self._workers.leave_group()
        except Exception:
            log.exception("leaving the broken weight-transfer group failed")


def _transport_error(what: str, exc: Exception, started: float, timeout: float) -> SkyrlError:
    """DEADLINE_EXCEEDED when the collective gave up after its timeout, else UNAVAILABLE."""
    elapsed = time.monotonic() - started
    if elapsed >= timeout:
        return DeadlineExceeded(f"{what} timed out after {elapsed:.0f} s: {exc}")
    return Unavailable(f"{what} failed: {exc}")
