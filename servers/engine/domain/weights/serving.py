"""The weights a server serves: their version, the prefix-cache namespace they own, and the
update path (``transaction.WeightTransferManager``) wired to the engine's primitives.

A change of the serving weights (a commit or a rollback) starts a new prefix-cache namespace,
so no request reuses KV computed under other weights; weights that held NaN or infinity also
get the KV cache memory cleared, since values they left in freed blocks poison later requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from servers.engine.domain.weights.readiness import UpdateReadiness
from servers.engine.domain.weights.transaction import PhaseObserver, WeightTransferManager
from servers.engine.domain.weights.update_log import UpdateLog
from servers.engine.options import STAGING_AT_START
from servers.engine.transfer.assembly import ParamLayout
from servers.engine.transfer.handoff import HandoffBuffer, buffer_bytes_for
from servers.engine.transfer.protocol import Lifecycle, WorkerCalls
from skyrl_grpc.errors import Aborted, FailedPrecondition

log = logging.getLogger(__name__)


class WeightsCannotReload(Exception):
    """The engine started, but reloading its weights (``ServingWeights.reload_at_start``)
    failed."""


class WeightEngine(Protocol):
    """What the weights need of the engine (``vllm_engine.VllmEngine`` has it)."""

    @property
    def paused(self) -> bool: ...
    @property
    def weight_lifecycle(self) -> Lifecycle: ...
    async def collective_rpc(self, method: str, args: tuple[Any, ...]) -> list[Any]: ...
    def unfinished_requests(self) -> int: ...
    async def try_reset_prefix_cache(self) -> bool: ...
    async def pause(self, mode: Any, clear_cache: bool) -> None: ...
    async def resume(self) -> None: ...


@dataclass(frozen=True)
class WeightRules:
    """What the update path is told (the server's flags): in-band bytes per worker call, an
    open update's lease, whether NaN and infinity are accepted."""

    stage_batch_bytes: int = 32 << 20
    lease_seconds: float = 600.0
    allow_non_finite: bool = False
    # When the first update's staging memory is allocated (``readiness``), and whether every
    # layer is reloaded once at start (all but "first-update").
    staging: str = STAGING_AT_START


class ServingWeights:
    """The serving version, its prefix-cache namespace, and ``updates`` (the update path)."""

    def __init__(
        self,
        engine: WeightEngine,
        rules: WeightRules,
        status_changed: Callable[[], None],
        on_phase: PhaseObserver | None = None,
    ) -> None:
        self._engine = engine
        self._status_changed = status_changed
        # Counts every change of the serving weights (commit or rollback): the prefix-cache
        # namespace of requests, so no request reuses KV computed under other weights.
        self.epoch = 0
        self.workers = WorkerCalls(
            engine.collective_rpc,
            engine.weight_lifecycle,
            HandoffBuffer(buffer_bytes_for(rules.stage_batch_bytes)),
        )
        # The last updates with their phases (what the status stream shows watchers).
        self.recent = UpdateLog(lambda: self.version, status_changed, on_phase)
        # The first update's staging memory, allocated when the rules say.
        self.readiness = UpdateReadiness(self._prepare_staging, rules.staging)
        self.updates = WeightTransferManager(
            self.workers,
            self._changed,
            before_open=self.readiness.before_update,
            default_lease_seconds=rules.lease_seconds,
            stage_batch_bytes=rules.stage_batch_bytes,
            allow_non_finite=rules.allow_non_finite,
            on_phase=self.recent.phase,
        )

    async def reload_at_start(self, trim: bool) -> None:
        """Reloads every layer once, at start, before anything is served: the weights stay
        what they are, and what vLLM's first reload pays once is not paid by the first update
        (``SkyrlWeightTransferEngine.warm_reload``). A failure fails the start: this model's
        weights could not be updated either. ``trim``: the heap the reload freed goes back to
        the system (an idle server holds no more than it serves with)."""
        started = time.monotonic()
        try:
            reloaded = await self.workers.warm_reload(trim)
        except Exception as error:
            raise WeightsCannotReload(
                f"the engine started but reloading its weights failed ({error}), so weight "
                "updates would fail too; start with --weight-staging first-update to serve it "
                "without preparing for updates"
            ) from error
        seconds = time.monotonic() - started
        log.info("weights reloaded once at start: %d parameters in %.2f s", reloaded, seconds)

    async def _prepare_staging(self) -> None:
        """The memory a full update stages into, allocated and touched (no model state is
        read or written: safe beside generations)."""
        started = time.monotonic()
        allocated = await self.workers.prepare_spares()
        log.info(
            "prepared for weight updates: %.2f GB of staging in %.2f s",
            allocated / 1e9,
            time.monotonic() - started,
        )

    def generation_starts(self) -> None:
        """A generation is handed to the engine (the readiness's cue)."""
        self.readiness.on_generation()

    @property
    def cache_salt(self) -> str:
        """The prefix-cache namespace of requests submitted now."""
        return f"skyrl-weights-{self.epoch}"

    @property
    def version(self) -> int:
        """The version the serving weights are (the update path's: only it changes them)."""
        return self.updates.version

    async def _changed(self, replaced_non_finite: bool) -> None:
        # Requests from now on hash their prompt blocks in a new namespace (cache_salt), so a
        # block computed under the previous weights is never reused, even where the reset
        # below fails because requests frozen by a KEEP pause still hold blocks (those finish
        # on the KV they have: KEEP's contract). The reset frees the stale blocks early.
        self.epoch += 1
        self._status_changed()
        if not await self._engine.try_reset_prefix_cache():
            log.info("prefix cache not reset after the weight change: requests hold blocks")
        if replaced_non_finite:
            await self._clear_kv_memory()

    async def _clear_kv_memory(self) -> None:
        """After weights holding NaN or infinity: zero the KV cache memory. Attention reads
        whole blocks and weighs unwritten slots by 0, and 0 x NaN is NaN, so values those
        weights left in freed blocks poison the next requests that get the blocks (measured:
        the first 32-request batch after restoring good weights was 0 of 32 correct, with the
        prefix cache reset). Only safe while no request holds KV."""
        if self._engine.unfinished_requests():
            log.warning(
                "the replaced weights held NaN or infinity and requests still hold KV: the KV "
                "cache memory is not cleared, so requests may see traces of them"
            )
            return
        paused = self._engine.paused
        if not paused:  # hold new requests back while the memory is cleared
            await self._engine.pause("abort", False)
        try:
            cleared = await self.workers.clear_kv_cache()
        finally:
            if not paused:
                await self._engine.resume()
        log.warning("replaced weights held NaN or infinity: %d bytes of KV cache cleared", cleared)

    async def readable(self) -> tuple[int, list[tuple[str, ParamLayout, bytes]]]:
        """What ``read`` gives now: the serving version, and every parameter (sorted by name)
        with its layout and the SHA-256 of its serving bytes."""
        version, epoch = self.version, self.epoch
        layout = await self.updates.layout()
        if not layout:
            raise FailedPrecondition(
                "this server keeps no checkpoint-format copy of its weights to read (its model "
                "has no safetensors files)"
            )
        sums = {row["name"]: row["sha256"] for row in await self.updates.checksums([])}
        self._check_unchanged(version, epoch)
        return version, [(name, layout[name], sums[name]) for name in sorted(layout)]

    async def read(
        self, version: int, names: list[str], batch_bytes: int = 64 << 20
    ) -> AsyncIterator[tuple[str, bytes]]:
        """The serving bytes of ``names``, in order, read from the workers about
        ``batch_bytes`` at a time; ABORTED once the serving weights are no longer ``version``
        (a commit or a rollback came between)."""
        layout = await self.updates.layout()
        epoch = self.epoch
        batch: list[str] = []
        size = 0
        for position, name in enumerate(names):
            batch.append(name)
            size += layout[name].num_bytes
            if size < batch_bytes and position + 1 < len(names):
                continue
            values = await self.workers.read(batch)
            self._check_unchanged(version, epoch)
            for read_name, value in zip(batch, values, strict=True):
                yield read_name, value
            batch, size = [], 0

    def _check_unchanged(self, version: int, epoch: int) -> None:
        if self.version != version or self.epoch != epoch:
            raise Aborted(
                f"the serving weights changed from version {version} to {self.version} while "
                "they were read: read them again"
            )

    async def close(self) -> None:
        await self.updates.close()
        self.workers.close()
