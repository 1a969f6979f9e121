"""The weight-update transaction of one engine server: ordering, staging, commit.

``WeightTransferManager`` is the state machine behind the ControlPlane weight RPCs. It reaches
vLLM's workers only through ``WorkerCalls`` (``protocol``), so its rules are tested without an
engine. An update is one transaction: StartWeightUpdate, any number of UpdateWeights
(collective) / PushWeights (in-band) calls, then FinishWeightUpdate. Everything received is
validated against the model's checkpoint layout (``assembly``) before it reaches a worker,
staged there, and applied only by Finish. Any failure rejects the whole update (staging is
discarded, the serving weights never change) and says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from skyrl_grpc import dtypes
from skyrl_grpc.chunk_wire import WireChunk
from skyrl_grpc.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    SkyrlError,
    Unavailable,
)
from skyrl_grpc.v1 import control_plane_pb2 as cp

from ...common.early_answer import read_rest
from .assembly import InBandAssembler, ParamLayout, bucket_layout, model_layout
from .protocol import Bucket, Group, StagedParameter, WorkerCalls

log = logging.getLogger(__name__)

STAGE_BATCH_BYTES = 32 << 20  # bytes per worker call when shipping in-band weights
DRAIN_SECONDS = 10.0  # how long a rejected push keeps reading before answering


class WeightTransferManager:
    """The weight-update transaction of one server."""

    def __init__(
        self,
        workers: WorkerCalls,
        set_version: Callable[[int], None],
        get_version: Callable[[], int],
        on_commit: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._workers = workers
        self._set_version = set_version
        self._get_version = get_version
        self._on_commit = on_commit
        self._layout: dict[str, ParamLayout] | None = None
        self.group: Group | None = None
        self.update_open = False
        self._lock = asyncio.Lock()

    async def layout(self) -> dict[str, ParamLayout]:
        if self._layout is None:
            self._layout = model_layout(await self._workers.layout())
        return self._layout

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

    async def start(self) -> None:
        async with self._lock:
            if self.update_open:
                raise FailedPrecondition(
                    "a weight update is already open: finish it (FinishWeightUpdate) or cancel it "
                    "(CancelWeightUpdate) first"
                )
            await self.layout()
            await self._workers.discard()
            self.update_open = True

    def _require_open(self, what: str) -> None:
        if not self.update_open:
            raise FailedPrecondition(f"{what} before StartWeightUpdate: open an update first")

    async def update(self, request: cp.UpdateWeightsRequest) -> tuple[int, int]:
        async with self._lock:
            group = self.group
            if group is None:
                raise FailedPrecondition(
                    "UpdateWeights before InitWeightTransfer: join the trainer's process group "
                    "first (or push in-band with PushWeights)"
                )
            self._require_open("UpdateWeights")
            layout = await self.layout()
            try:
                buckets = [bucket_layout(b, layout) for b in request.buckets]
            except SkyrlError:
                # The trainer broadcasts regardless: receive and drop the bytes so neither side
                # hangs, then reject.
                empty = [Bucket(size=b.size_bytes, params=[]) for b in request.buckets]
                await self._abandon(self._workers.receive_buckets(empty))
                raise
            started = time.monotonic()
            try:
                results = await self._workers.receive_buckets(buckets)
            except Exception as exc:
                await self._abandon(None)
                await self._leave_broken_group()
                raise _transport_error(
                    "receiving weight buckets", exc, started, group["timeout_seconds"]
                ) from exc
            mismatches = sorted({m for r in results for m in r["mismatches"]})
            if mismatches:
                await self._abandon(None)
                raise DataLoss(
                    f"checksum mismatch for {', '.join(mismatches)}: update rejected, the serving "
                    "weights are unchanged; start a new update"
                )
            return results[0]["params"], results[0]["bytes"]

    async def _leave_broken_group(self) -> None:
        """A failed collective leaves the group unusable: leave it, so a new
        InitWeightTransfer starts clean."""
        self.group = None
        try:
            await self._workers.leave_group()
        except Exception:
            log.exception("leaving the broken weight-transfer group failed")

    async def push(
        self, messages: AsyncIterator[cp.PushWeightsRequest | WireChunk]
    ) -> tuple[int, int]:
        try:
            return await self._push(messages)
        except SkyrlError:
            await read_rest(messages, DRAIN_SECONDS)
            raise

    async def _push(
        self, messages: AsyncIterator[cp.PushWeightsRequest | WireChunk]
    ) -> tuple[int, int]:
        async with self._lock:
            self._require_open("PushWeights")
            assembler = InBandAssembler(await self.layout())
            try:
                async for message in messages:
                    assembler.add(message)
                params = assembler.finish()
            except SkyrlError as error:
                await self._abandon(None)
                raise type(error)(
                    f"{error}; update rejected, the serving weights are unchanged"
                ) from error
            except asyncio.CancelledError:
                await self._abandon(None)  # the sender went away mid-stream
                raise
            for batch in _batches(params, STAGE_BATCH_BYTES):
                await self._workers.stage(batch)
            return len(params), assembler.bytes_received

    async def finish(self, weight_version: int) -> tuple[int, int]:
        async with self._lock:
            self._require_open("FinishWeightUpdate")
            current = self._get_version()
            if weight_version <= current:
                raise InvalidArgument(
                    f"weight_version = {weight_version} is not newer than the serving version "
                    f"{current}: versions must increase"
                )
            try:
                replaced = await self._workers.commit()
            except Exception as exc:
                await self._abandon(None)
                raise Unavailable(
                    f"applying the new weights failed (previous weights restored): {exc}"
                ) from exc
            self.update_open = False
            self._set_version(weight_version)
            if self._on_commit is not None:
                await self._on_commit()
            return weight_version, replaced

    async def cancel(self) -> int:
        async with self._lock:
            self._require_open("CancelWeightUpdate")
            discarded = await self._workers.discard()
            self.update_open = False
            return discarded

    async def checksums(self, names: list[str]) -> list[cp.ParameterChecksum]:
        layout = await self.layout()
        unknown = [n for n in names if n not in layout]
        if unknown:
            raise InvalidArgument(f"unknown parameter(s): {', '.join(unknown)}")
        return [
            cp.ParameterChecksum(
                name=row["name"],
                sha256=row["sha256"],
                dtype=dtypes.BY_TORCH[row["dtype"]].proto,
                shape=row["shape"],
            )
            for row in await self._workers.checksums(names)
        ]

    async def _abandon(self, pending: Awaitable[object] | None) -> None:
        """Rejects the open update: staging dropped, the update closed."""
        try:
            if pending is not None:
                await pending
        finally:
            self.update_open = False
            try:
                await self._workers.discard()
            except Exception:
                log.exception("discarding staged weights failed")


def _batches(params: list[StagedParameter], batch_bytes: int) -> list[list[StagedParameter]]:
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


def _transport_error(what: str, exc: Exception, started: float, timeout: float) -> SkyrlError:
    """DEADLINE_EXCEEDED when the collective gave up after its timeout, else UNAVAILABLE."""
    elapsed = time.monotonic() - started
    if elapsed >= timeout:
        return DeadlineExceeded(f"{what} timed out after {elapsed:.0f} s: {exc}")
    return Unavailable(f"{what} failed: {exc}")
