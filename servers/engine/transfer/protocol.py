"""The calls between the engine server and vLLM's workers for weight updates.

Weights reach the model through vLLM's own weight-transfer lifecycle, driven on ``AsyncLLM``
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update(weight_version)``), which runs this project's engine
(``transfer_engine.SkyrlWeightTransferEngine``) in every worker. What the lifecycle does not
carry (the layout, checksums, the last call's report, dropping the rollback copy, clearing KV
memory) goes through ``collective_rpc`` to the worker extension (``worker``). Everything crosses
without pickle: plain values, lists, dicts and bytes. This module is the one definition both
sides import: the payloads and ``WorkerCalls``, the server's typed view of all of it
(``transaction`` never names a method by string). Every call runs on every worker of the engine
(one per tensor/pipeline rank); results come back one per worker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NotRequired, Protocol, TypedDict

from servers.engine.transfer.handoff import HandoffBuffer

# The name vLLM's weight-transfer factory knows ``transfer_engine``'s engine by: engines start
# with ``weight_transfer_config={"backend": BACKEND}``.
BACKEND = "skyrl"

# Methods of ``servers.engine.worker.worker_extension.WeightTransferWorker`` (``collective_rpc``).
LAYOUT = "skyrl_layout"
CHECKSUMS = "skyrl_checksums"
REPORT = "skyrl_report"
RECYCLE_ROLLBACK = "skyrl_recycle_rollback"
FREE_ROLLBACK = "skyrl_free_rollback"
CLEAR_KV_CACHE = "skyrl_clear_kv_cache"
READ = "skyrl_read"
WARM_RELOAD = "skyrl_warm_reload"
PREPARE_SPARES = "skyrl_prepare_spares"
METHODS = (
    LAYOUT,
    CHECKSUMS,
    REPORT,
    RECYCLE_ROLLBACK,
    FREE_ROLLBACK,
    CLEAR_KV_CACHE,
    READ,
    WARM_RELOAD,
    PREPARE_SPARES,
)


class ParameterShape(TypedDict):
    """A checkpoint parameter's element type (torch's name, e.g. "float32") and shape."""

    dtype: str
    shape: list[int]


class StagedParameter(TypedDict):
    """In-band bytes of one parameter, verified by the server: the chunks received from byte
    ``offset`` of its value on (a whole value may come in several pieces, in order; ``last``:
    this piece completes it). A patch (``patch`` > 0 elements changed) comes whole, naming the
    changed elements (indices, or a bitmap with ``bitmap``) then carrying their values
    (``skyrl_grpc.patch_format``); the worker applies it to the serving weights and checks the
    result against ``sha256`` (b"": not checked)."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    chunks: list[bytes | memoryview]
    last: bool
    patch: int
    bitmap: bool
    sha256: bytes
    # Where the bytes lie in the server's shared-memory buffer (``[start, length]``, the
    # buffer named by the call's ``handoff``) instead of in ``chunks`` (``handoff``).
    region: NotRequired[list[int]]
    # A patch that came compressed, decompressed by the server: its values are XORs with the
    # serving ones (``patch_format.decompress``), so the worker checks them once applied.
    xor: NotRequired[bool]


class BucketParameter(TypedDict):
    """Where one parameter lies in a broadcast bucket, and its expected SHA-256 (or b""). A
    patch (``patch`` > 0 elements changed) lies there as in-band (names, a bitmap with
    ``bitmap``, then values); its SHA-256 is of the parameter once patched."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    sha256: bytes
    patch: int
    bitmap: bool
    # A compressed patch: the bytes of its zstd frame there (``patch_format.decompress``).
    zstd: NotRequired[int]


class Bucket(TypedDict):
    """One broadcast of ``size`` bytes holding ``params`` (validated against the model)."""

    size: int
    params: list[BucketParameter]


class Report(TypedDict):
    """What one worker's last ``update_weights`` or ``finish_weight_update`` did: bytes
    received by broadcast, parameters staged, parameters changed (discarded, committed or
    restored); ``mismatches`` names parameters whose SHA-256 did not match, ``invalid`` says
    which broadcast patches do not fit their parameter (indices out of range or not increasing,
    a bitmap naming another count or elements past the last, a compressed one that does not
    decompress to its size): nothing of the call is staged if either is non-empty;
    ``non_finite`` names those holding a NaN or infinity (broadcast ones when checked, and
    compressed patches once applied): staged, the server refuses or accepts them; ``error``:
    applying failed and the previous weights were restored; ``handoff_error``: why the worker
    could not map the server's shared-memory buffer (nothing of the call staged: the server
    sends it again inline)."""

    bytes: int
    params: int
    changed: int
    mismatches: list[str]
    non_finite: list[str]
    invalid: list[str]
    error: str
    handoff_error: str


def empty_report() -> Report:
    """A report of a call that did nothing (yet)."""
    return Report(
        bytes=0,
        params=0,
        changed=0,
        mismatches=[],
        non_finite=[],
        invalid=[],
        error="",
        handoff_error="",
    )


class Checksum(TypedDict):
    name: str
    sha256: bytes
    dtype: str
    shape: list[int]


class Group(TypedDict):
    """How the workers join the trainer's process group (see ``skyrl_grpc.process_group``)."""

    backend: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    timeout_seconds: float


Rpc = Callable[[str, tuple[Any, ...]], Awaitable[list[Any]]]

# The server's --weight-heap-slack, as its engine's workers inherit it (``heap.HeapKeeper``).
HEAP_SLACK_ENVIRONMENT = "SKYRL_WEIGHT_HEAP_SLACK"
# The server's --weight-commit-prepare, as its engine's workers inherit it ("1": on;
# ``worker.prepared_layers``).
COMMIT_PREPARE_ENVIRONMENT = "SKYRL_WEIGHT_COMMIT_PREPARE"

# What vLLM's worker says when ``start_weight_update`` finds a session still open.
STALE_SESSION = "weight update is already active"


class Lifecycle(Protocol):
    """vLLM's weight-transfer lifecycle as ``AsyncLLM`` has it (requests as plain dicts)."""

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    async def shutdown_weight_transfer_engine(self) -> None: ...

    async def start_weight_update(self) -> None: ...

    async def update_weights(self, update_info: dict[str, Any]) -> None: ...

    async def finish_weight_update(self, weight_version: str | None) -> None: ...


class WorkerCalls:
    """The server's typed calls to every worker: vLLM's lifecycle for anything that changes
    weights, ``rpc(method, args)`` (``collective_rpc`` on a real engine; plain functions in
    tests) for the rest.

    vLLM's worker holds one update session at a time: ``start_weight_update`` opens it, and
    ``finish_weight_update`` closes it; an ``update_weights`` that raises closes it too.
    ``session_open`` follows that, so ``discard`` closes exactly what is open."""

    def __init__(
        self, rpc: Rpc, lifecycle: Lifecycle, handoff: HandoffBuffer | None = None
    ) -> None:
        self._rpc = rpc
        self._lifecycle = lifecycle
        self.session_open = False
        # In-band bytes go to the workers through this buffer where they fit (``handoff``).
        self._handoff = handoff

    async def layout(self) -> dict[str, ParameterShape]:
        """Every checkpoint parameter (the first worker's view: all hold the same names)."""
        result: dict[str, ParameterShape] = (await self._rpc(LAYOUT, ()))[0]
        return result

    async def checksums(self, names: list[str]) -> list[Checksum]:
        result: list[Checksum] = (await self._rpc(CHECKSUMS, (names,)))[0]
        return result

    async def read(self, names: list[str]) -> list[bytes]:
        """The serving bytes of ``names`` (checkpoint format), from the worker holding them."""
        result: list[bytes] = (await self._rpc(READ, (names,)))[0]
        return result

    async def warm_reload(self, trim: bool = False) -> int:
        """Reloads every layer from the serving weights, on every worker in step (at start:
        the weights stay what they are); with ``trim`` each worker then gives the heap the
        reload freed back to the system. Returns the parameters reloaded."""
        reloaded: list[int] = await self._rpc(WARM_RELOAD, (trim,))
        return max(reloaded, default=0)

    async def prepare_spares(self) -> int:
        """Allocates and touches the memory a full update stages into (at the worker keeping
        the checkpoint copy); returns its bytes."""
        allocated: list[int] = await self._rpc(PREPARE_SPARES, ())
        return sum(allocated)

    async def join_group(self, group: Group) -> None:
        """Joins every worker to the trainer's group (each as ``rank_offset`` + its rank)."""
        await self._lifecycle.init_weight_transfer_engine(dict(group))

    async def leave_group(self) -> None:
        await self._lifecycle.shutdown_weight_transfer_engine()

    async def open(self) -> None:
        """Opens an update session (closing one left open first)."""
        await self.discard()
        try:
            await self._lifecycle.start_weight_update()
        except Exception as error:
            if STALE_SESSION not in str(error):
                raise
            # vLLM's worker kept a session that an engine error left open (a finish that
            # raised keeps it): drop what it staged, close it, open anew.
            self.session_open = True
            await self.discard()
            await self._lifecycle.start_weight_update()
        self.session_open = True

    async def _update(self, update_info: dict[str, Any]) -> list[Report]:
        try:
            await self._lifecycle.update_weights(update_info)
        except Exception:
            self.session_open = False  # vLLM's worker ended the session
            raise
        # Cancelled (the caller went away): the call goes on in the engine, the session stays.
        return await self._reports()

    async def _reports(self) -> list[Report]:
        reports: list[Report] = await self._rpc(REPORT, ())
        return reports

    async def receive_buckets(self, buckets: list[Bucket], check_finite: bool) -> list[Report]:
        return await self._update({"receive": buckets, "check_finite": check_finite})

    async def stage(self, params: list[StagedParameter]) -> tuple[list[str], list[str]]:
        """Stages the parameters on every worker, in order; returns the names whose patched
        bytes did not match their SHA-256 (nothing of the call is staged then), and those of
        compressed patches that made a value non-finite (staged: the server decides). Where
        the bytes go through the shared buffer, ``params`` give up their chunks."""
        remaining = params
        non_finite: set[str] = set()
        while remaining:
            reports, remaining = await self._stage_some(remaining)
            mismatches = {str(name) for report in reports for name in report["mismatches"]}
            if mismatches:
                return sorted(mismatches), []  # the update is rejected: the rest need not go
            non_finite.update(str(name) for report in reports for name in report["non_finite"])
        return [], sorted(non_finite)

    async def _stage_some(
        self, params: list[StagedParameter]
    ) -> tuple[list[Report], list[StagedParameter]]:
        """One worker call for the first of ``params``: those that fit the shared buffer (the
        first alone, inline, when even it does not); returns its reports and the rest."""
        handoff = self._handoff
        regions = handoff.place([p["chunks"] for p in params]) if handoff is not None else None
        if handoff is None or regions is None:
            return await self._update({"stage": params}), []
        if not regions:
            return await self._update({"stage": params[:1]}), params[1:]
        placed = []
        for param, region in zip(params, regions, strict=False):
            # The bytes lie in the buffer now: the received messages they came in can go
            # while the workers copy (the server then holds one batch of them, not two).
            param["chunks"] = []
            placed.append(StagedParameter({**param, "region": region}))
        reports = await self._update({"stage": placed, "handoff": handoff.path})
        unreadable = sorted({r["handoff_error"] for r in reports if r["handoff_error"]})
        if unreadable:
            inline = [_inline(param, handoff) for param in placed]
            handoff.give_up("; ".join(unreadable))
            reports = await self._update({"stage": inline})
        else:
            handoff.mapped()
        return reports, params[len(regions) :]

    def close(self) -> None:
        if self._handoff is not None:
            self._handoff.close()

    async def discard(self) -> int:
        """Ends the open session without applying it; returns how many parameters it had
        changed (0 when none was open)."""
        if not self.session_open:
            return 0
        try:
            reports = await self._update({"discard": True})
        except Exception:
            return 0  # vLLM's worker had already ended the session (and this one with it)
        await self._finish(None)
        return reports[0]["changed"]

    async def _finish(self, weight_version: str | None) -> list[Report]:
        self.session_open = False
        await self._lifecycle.finish_weight_update(weight_version)
        return await self._reports()

    async def commit(self, weight_version: int) -> int:
        """Makes the staged parameters serve as ``weight_version``, keeping the previous
        weights for a rollback; returns how many were replaced. Raises when applying failed
        (the previous weights serve again)."""
        reports = await self._finish(str(weight_version))
        errors = sorted({report["error"] for report in reports if report["error"]})
        if errors:
            raise RuntimeError("; ".join(errors))
        return reports[0]["changed"]

    async def rollback(self, weight_version: int) -> int:
        """Serves the weights from before the last commit again, as ``weight_version``;
        returns how many parameters were restored."""
        await self.open()
        await self._update({"restore_previous": True})
        return (await self._finish(str(weight_version)))[0]["changed"]

    async def recycle_rollback(self) -> None:
        """Ends the rollback window as a new update starts: the weights kept for it become
        that update's staging (their memory is reused, not freed: ``free_rollback`` frees)."""
        await self._rpc(RECYCLE_ROLLBACK, ())

    async def free_rollback(self) -> int:
        """Frees the weights kept for a rollback, on every rank, and returns the memory to the
        system; returns the bytes of weights freed."""
        return int(sum(await self._rpc(FREE_ROLLBACK, ())))

    async def clear_kv_cache(self) -> int:
        """Zeroes the KV cache memory (only while no request holds KV); returns its bytes."""
        return int(sum(await self._rpc(CLEAR_KV_CACHE, ())))


def _inline(param: StagedParameter, handoff: HandoffBuffer) -> StagedParameter:
    """``param`` with its bytes inline again (read back from the buffer where they lie)."""
    region = param.get("region")
    if region is None:
        return param
    inline = StagedParameter({**param, "chunks": [handoff.read(region)]})
    del inline["region"]
    return inline
