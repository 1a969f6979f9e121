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
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from servers.common.tasks import BackgroundTasks
from servers.engine.domain.weights.collective_receive import CollectiveReceive
from servers.engine.domain.weights.relay_role import MIN_TICKET_BYTES, RelayRole
from servers.engine.domain.weights.staging import OpenUpdate, StagingPipeline, staging_batches
from servers.engine.transfer.assembly import (
    InBandAssembler,
    ParamLayout,
    PatchBaseMismatch,
    check_stream_bases,
    model_layout,
    non_finite_error,
)
from servers.engine.transfer.protocol import Checksum, Group, StagedParameter, WorkerCalls
from servers.engine.transfer.specs import Manifest
from skyrl_grpc.chunk_wire import WireChunk
from skyrl_grpc.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    SkyrlError,
    Unavailable,
)

log = logging.getLogger(__name__)
# Told when a phase of an update ended well (start, transfer: each stream or broadcast,
# commit, rollback): its name, its seconds, the bytes it received (the server's metrics).
PhaseObserver = Callable[[str, float, int], None]


class WeightTransferManager(CollectiveReceive):
    """The weight-update transaction of one server.

    Every weight RPC runs under one lock, so calls of an update never interleave, but for its
    in-band streams, which are staged side by side, checked against the update at each
    worker call and awaited by its commit. An open
    update holds a lease: when no call of it has come for ``lease_seconds``, it expires (its
    staging is dropped) and another trainer may start one. A commit keeps the previous weights
    until the next update starts, for ``rollback``.
    """

    def __init__(
        self,
        workers: WorkerCalls,
        on_weights_changed: Callable[[bool], Awaitable[None]] | None = None,
        *,
        version: int = 0,
        default_lease_seconds: float = 600.0,
        allow_non_finite: bool = False,
        stage_batch_bytes: int = 32 << 20,
        on_phase: PhaseObserver | None = None,
        before_open: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._workers = workers
        # Awaited before an update opens (the server's first update's preparation).
        self._before_open = before_open
        self._on_phase = on_phase
        # The version the serving weights are: this transaction's, changed by a commit or a
        # rollback only.
        self.version = version
        self._on_weights_changed = on_weights_changed
        self.default_lease_seconds = default_lease_seconds
        self.allow_non_finite = allow_non_finite
        # In-band bytes per worker call: large enough to amortise a call, small enough that the
        # server and the engine core never hold much of a push.
        self.stage_batch_bytes = stage_batch_bytes
        self._layout: dict[str, ParamLayout] | None = None
        self.group: Group | None = None
        self.open: OpenUpdate | None = None
        # The version a rollback returns to (None: nothing kept to roll back to).
        self.rollback_version: int | None = None
        # Whether the serving weights, and those a rollback returns to, hold NaN or infinity.
        self._serving_non_finite = False
        self._rollback_non_finite = False
        self._lock = asyncio.Lock()
        # Held by each worker call that stages a stream's bytes, and by a discard: the calls
        # of an update's streams go one at a time, and none lands after its update closed.
        self._staging = asyncio.Lock()
        self._tasks = BackgroundTasks()

    def _observed(self, phase: str, started: float, nbytes: int = 0) -> None:
        """Tells ``on_phase`` a phase of an update ended well: its seconds, its bytes."""
        if self._on_phase is not None:
            self._on_phase(phase, time.monotonic() - started, nbytes)

    @property
    def update_open(self) -> bool:
        return self.open is not None

    async def layout(self) -> dict[str, ParamLayout]:
        if self._layout is None:
            self._layout = model_layout(await self._workers.layout())
        return self._layout

    def _check_version(self, version: int, allow_same: bool) -> None:
        current = self.version
        if version > current or (allow_same and version == current):
            return
        rule = "newer than or equal to" if allow_same else "newer than"
        raise InvalidArgument(
            f"weight_version = {version} is not {rule} the serving version {current}: versions "
            f"must increase (use {current + 1}, or allow_same_version to re-push {current})"
        )

    async def start(
        self,
        weight_version: int = 0,
        *,
        allow_same_version: bool = False,
        owner: str = "",
        lease_seconds: float = 0,
        ticket: bytes = b"",
        relay: RelayRole | None = None,
    ) -> OpenUpdate:
        """Opens an update for ``weight_version`` (0: named at finish), checked now; with
        ``ticket`` (the trainer's choice: a relay plan names every server's beforehand) as its
        ticket, and ``relay`` as this server's place in the update's relay plan."""
        started = time.monotonic()
        owner = owner or "unknown"
        if ticket and len(ticket) < MIN_TICKET_BYTES:
            raise InvalidArgument(
                f"push_ticket is {len(ticket)} bytes: give {MIN_TICKET_BYTES} or more random "
                "bytes, or none (the server then chooses one)"
            )
        async with self._lock:
            current = self.open
            if current is not None:
                if current.idle_seconds >= current.lease_seconds:
                    log.warning(
                        "the weight update of %s expired (idle %.0f s): discarded",
                        current.owner,
                        current.idle_seconds,
                    )
                elif owner == "unknown" or current.owner != owner:
                    left = current.lease_seconds - current.idle_seconds
                    raise FailedPrecondition(
                        f"a weight update is already open (owner {current.owner}, open "
                        f"{current.age_seconds:.0f} s): finish it (FinishWeightUpdate) or cancel "
                        f"it (CancelWeightUpdate) first, or wait {left:.0f} s for its lease "
                        "to expire"
                    )
                else:
                    log.info("%s restarts its weight update", owner)
                await self._close()
            if weight_version:
                self._check_version(weight_version, allow_same_version)
            await self.layout()
            if self._before_open is not None:
                await self._before_open()
            await self._workers.recycle_rollback()
            await self._workers.open()
            self.rollback_version = None
            update = OpenUpdate(
                owner=owner,
                target_version=weight_version,
                allow_same_version=allow_same_version,
                lease_seconds=lease_seconds or self.default_lease_seconds,
                relay=relay,
            )
            if ticket:
                update.ticket = ticket
            self.open = update
            self._tasks.spawn(self._expire_when_idle(update), name="weight update lease")
            self._observed("start", started)
            return update

    async def _expire_when_idle(self, update: OpenUpdate) -> None:
        while self.open is update:
            remaining = update.lease_seconds - update.idle_seconds
            if remaining > 0:
                await asyncio.sleep(remaining)
                continue
            async with self._lock:  # waits for a call in progress, which renews the lease
                if self.open is update and update.idle_seconds >= update.lease_seconds:
                    log.warning(
                        "the weight update of %s expired after %.0f s without a call: discarded",
                        update.owner,
                        update.idle_seconds,
                    )
                    await self._close()

    def _require_open(self, what: str, ticket: bytes | None = None) -> OpenUpdate:
        if self.open is None:
            raise FailedPrecondition(
                f"{what} before StartWeightUpdate: open an update first (an update also "
                "closes when it is rejected, cancelled or its lease expires)"
            )
        self.open.check_ticket(ticket)
        self.open.touch()
        return self.open

    def check_ticket(self, ticket: bytes) -> None:
        """Raises unless ``ticket`` is the open update's (a push socket's hello)."""
        self._require_open("a push socket connection", ticket)

    def check_sender(
        self, ticket: bytes | None, relayed_from: str, tree: int | None = None
    ) -> OpenUpdate:
        """The open update, if a stream presenting ``ticket`` (None: a gRPC call, authorised by
        its channel) and forwarded by ``relayed_from`` ("": the trainer) may stream into it;
        raises otherwise, before anything is staged."""
        update = self._require_open("a weight stream")
        update.check_sender(ticket, relayed_from, tree)
        return update

    async def push(
        self, items: AsyncIterator[Manifest | WireChunk], ticket: bytes | None = None
    ) -> tuple[int, int]:
        """Stages one in-band stream (from a push socket: for the update whose ``ticket`` it
        presented, and no other): a manifest, then its chunks, then any further manifest with
        its chunks. Streams of one update are staged side by side (a server in several relay
        trees takes one from each parent at once), their worker calls one at a time; a
        parameter is staged by one stream at a time."""
        started = time.monotonic()
        async with self._lock:
            update = self._require_open("PushWeights", ticket)
            layout = await self.layout()
        update.streams += 1
        # Bytes go on to the workers as they arrive, in batches, one batch in flight while the
        # next is received and checked: the server holds at most two batches per stream, never
        # the whole stream nor a whole large parameter, and reading the stream overlaps the
        # workers' copying instead of alternating with it.
        staging = StagingPipeline(functools.partial(self._stage, update))
        assembler: InBandAssembler | None = None
        arriving: set[str] = set()
        received = manifests = 0
        try:
            async for item in items:
                if isinstance(item, Manifest):
                    if assembler is not None:  # the next group: the one before is complete
                        await staging.send(assembler.finish())
                        received += assembler.bytes_received
                        update.non_finite = update.non_finite or bool(assembler.non_finite)
                    assembler = InBandAssembler(layout, self.allow_non_finite)
                    assembler.add(item)
                    check_stream_bases(assembler.patch_bases, self.version, not manifests)
                    update.release(arriving)
                    arriving = update.claim(spec.name for spec in item.parameters)
                    manifests += 1
                elif assembler is None:
                    raise InvalidArgument("the first PushWeights message must be the manifest")
                else:
                    assembler.add(item)
                    if assembler.ready_bytes >= self.stage_batch_bytes:
                        await staging.send(assembler.take_ready())
                update.bytes_received += len(item.data) if isinstance(item, WireChunk) else 0
                update.touch()
            if assembler is None:
                raise InvalidArgument("the PushWeights stream was empty (no manifest)")
            await staging.send(assembler.finish())
            received += assembler.bytes_received
            staged = await staging.drain()
        except PatchBaseMismatch:
            raise  # nothing staged: the update stays open for the whole weights
        except SkyrlError as error:
            await self._abandon(staging.settle(), update)
            raise type(error)(
                f"{error}; update rejected, the serving weights are unchanged"
            ) from error
        except BaseException:
            # The sender went away mid-stream, or a worker failed.
            await self._abandon(staging.settle(), update)
            raise
        finally:
            update.release(arriving)
            update.streams -= 1
        update.parameters_staged += staged
        update.non_finite = update.non_finite or bool(assembler.non_finite)
        update.touch()
        self._observed("transfer", started, received)
        return staged, received

    async def _stage(self, update: OpenUpdate, params: list[StagedParameter]) -> int:
        """Stages ``params`` into ``update`` in batches, one worker call at a time across its
        streams (the workers read every batch from one shared buffer); compressed patches
        whose values proved non-finite once applied are refused, or recorded where the server
        accepts them."""
        for batch in staging_batches(params, self.stage_batch_bytes):
            async with self._staging:
                if self.open is not update:
                    raise FailedPrecondition(
                        "the weight update closed while this stream was staging (cancelled, "
                        "expired, or rejected by another of its streams)"
                    )
                mismatches, applied_non_finite = await self._workers.stage(batch)
            if mismatches:
                raise DataLoss(
                    f"checksum mismatch for {', '.join(mismatches[:3])} after applying the "
                    "patch: the result differs from the sender's weights"
                )
            if applied_non_finite and not self.allow_non_finite:
                raise non_finite_error(applied_non_finite[0])
            update.non_finite = update.non_finite or bool(applied_non_finite)
        return sum(1 for param in params if param["last"])

    async def finish(self, weight_version: int = 0) -> tuple[int, int]:
        started = time.monotonic()
        async with self._lock:
            update = self._require_open("FinishWeightUpdate")
            if update.streams:
                raise FailedPrecondition(
                    f"FinishWeightUpdate while {update.streams} weight stream(s) of the update "
                    "are still arriving: finish once every stream was answered"
                )
            target = update.target_version
            if target and weight_version and weight_version != target:
                raise InvalidArgument(
                    f"weight_version = {weight_version}, but StartWeightUpdate opened the update "
                    f"for version {target}: send {target} or 0"
                )
            version = weight_version or target
            if not version:
                raise InvalidArgument(
                    "weight_version = 0 and StartWeightUpdate named no version: name the version "
                    "the new weights serve as"
                )
            self._check_version(version, update.allow_same_version)
            previous = self.version
            try:
                replaced = await self._workers.commit(version)
            except Exception as exc:
                await self._abandon(None)
                raise Unavailable(
                    f"applying the new weights failed (previous weights restored): {exc}"
                ) from exc
            await self._close(discard=False)
            self.rollback_version = previous
            self.version = version
            replaced_non_finite = self._serving_non_finite
            self._rollback_non_finite = replaced_non_finite
            self._serving_non_finite = update.non_finite
            await self._weights_changed(replaced_non_finite)
            self._observed("commit", started)
            return version, replaced

    async def rollback(self, weight_version: int) -> int:
        """Serves the weights from before the last commit again, if ``weight_version`` (what
        that commit made serve) still serves; returns the version serving now."""
        started = time.monotonic()
        async with self._lock:
            current = self.version
            if self.rollback_version is None:
                raise FailedPrecondition(
                    "nothing to roll back: no update was committed since the last "
                    "StartWeightUpdate or ReleaseRollback (the trainer client releases the "
                    "previous weights when told update_weights(..., release_memory=True))"
                )
            if weight_version != current:
                raise FailedPrecondition(
                    f"weight_version = {weight_version} is not the serving version {current}: "
                    "only the last commit can be rolled back"
                )
            restored = self.rollback_version
            try:
                await self._workers.rollback(restored)
            except Exception as exc:
                raise Unavailable(f"restoring the previous weights failed: {exc}") from exc
            self.rollback_version = None
            self.version = restored
            replaced_non_finite = self._serving_non_finite
            self._serving_non_finite = self._rollback_non_finite
            await self._weights_changed(replaced_non_finite)
            log.warning("weights rolled back from version %d to %d", current, restored)
            self._observed("rollback", started)
            return restored

    async def release_rollback(self, weight_version: int) -> int:
        """Ends the rollback window of ``weight_version``'s commit (the fleet committed it):
        the previous weights' memory goes back to the system; returns the bytes freed."""
        async with self._lock:
            if weight_version != (current := self.version):
                raise FailedPrecondition(
                    f"weight_version = {weight_version} is not the serving version {current}"
                )
            if self.open is not None:
                return 0  # the open update holds what it staged; nothing kept to roll back
            self.rollback_version = None
            return await self._workers.free_rollback()

    async def _weights_changed(self, replaced_non_finite: bool) -> None:
        """Tells the engine the serving weights changed, and whether the ones they replaced
        held non-finite values (whose traces in KV cache memory must be cleared)."""
        if self._on_weights_changed is not None:
            await self._on_weights_changed(replaced_non_finite)

    async def cancel(self) -> int:
        async with self._lock:
            self._require_open("CancelWeightUpdate")
            return await self._close()

    async def _close(self, discard: bool = True) -> int:
        """Closes the open update, dropping what it staged; returns how much that was. A worker
        call of one of its streams still running finishes first: nothing staged for it can
        land after the discard."""
        update, self.open = self.open, None
        if update is not None:
            update.closed()
        if not discard:
            return 0
        async with self._staging:
            return await self._workers.discard()

    async def checksums(self, names: list[str]) -> list[Checksum]:
        layout = await self.layout()
        unknown = [n for n in names if n not in layout]
        if unknown:
            raise InvalidArgument(f"unknown parameter(s): {', '.join(unknown)}")
        return await self._workers.checksums(names)

    async def _abandon(
        self, pending: Awaitable[object] | None, update: OpenUpdate | None = None
    ) -> None:
        """Rejects the open update (``update``, if it is still the open one): staging dropped,
        the update closed."""
        try:
            if pending is not None:
                await pending
        finally:
            if update is None or self.open is update:
                update, self.open = self.open, None
                if update is not None:
                    update.closed()
                try:
                    async with self._staging:
                        await self._workers.discard()
                except Exception:
                    log.exception("discarding staged weights failed")

    async def close(self) -> None:
        """Stops the lease timer (server shutdown)."""
        await self._tasks.close()
