"""The calls between the engine server and the worker extension inside vLLM's workers.

The server reaches the workers only through vLLM's ``collective_rpc(method_name, args)``, whose
arguments and results are serialized without pickle: plain values, lists, dicts and bytes.
This module is the one definition both sides import: the method names, the typed payloads, and
``WorkerCalls``, the server's typed view of the calls (``transaction`` never names a method by
string). Every method runs on every worker of the engine (one per tensor/pipeline rank); the
results come back one per worker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypedDict

# Method names of ``servers.engine.weights.worker.WeightTransferWorker``.
LAYOUT = "skyrl_layout"
CHECKSUMS = "skyrl_checksums"
JOIN_GROUP = "skyrl_join_group"
LEAVE_GROUP = "skyrl_leave_group"
RECEIVE_BUCKETS = "skyrl_receive_buckets"
STAGE = "skyrl_stage"
DISCARD = "skyrl_discard"
COMMIT = "skyrl_commit"
ROLLBACK = "skyrl_rollback"
RELEASE_ROLLBACK = "skyrl_release_rollback"
CLEAR_KV_CACHE = "skyrl_clear_kv_cache"
METHODS = (
    LAYOUT,
    CHECKSUMS,
    JOIN_GROUP,
    LEAVE_GROUP,
    RECEIVE_BUCKETS,
    STAGE,
    DISCARD,
    COMMIT,
    ROLLBACK,
    RELEASE_ROLLBACK,
    CLEAR_KV_CACHE,
)


# A patch's bytes start with its changed elements' indices, little-endian uint32 each
# (control_plane.proto's WeightPatch).
PATCH_INDEX_BYTES = 4


class ParameterShape(TypedDict):
    """A checkpoint parameter's element type (torch's name, e.g. "float32") and shape."""

    dtype: str
    shape: list[int]


class StagedParameter(TypedDict):
    """An in-band parameter, verified by the server: its bytes as the chunks received. A
    patch (``patch`` > 0 elements changed) carries the indices then the values
    (``control_plane.proto``'s WeightPatch); the worker applies it to the serving weights and
    checks the result against ``sha256`` (b"": not checked)."""

    name: str
    dtype: str
    shape: list[int]
    chunks: list[bytes | memoryview]
    patch: int
    sha256: bytes


class BucketParameter(TypedDict):
    """Where one parameter lies in a broadcast bucket, and its expected SHA-256 (or b"")."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    sha256: bytes


class Bucket(TypedDict):
    """One broadcast of ``size`` bytes holding ``params`` (validated against the model)."""

    size: int
    params: list[BucketParameter]


class Received(TypedDict):
    """What one worker received by broadcast; ``mismatches`` names parameters whose SHA-256
    did not match, ``non_finite`` those holding a NaN or infinity (when checked); nothing of
    the call is staged if either is non-empty."""

    bytes: int
    params: int
    mismatches: list[str]
    non_finite: list[str]


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


class WorkerCalls:
    """The server's typed calls to every worker, over an ``rpc(method, args)`` callable
    (``collective_rpc`` on a real engine; a plain function in tests)."""

    def __init__(self, rpc: Rpc) -> None:
        self._rpc = rpc

    async def layout(self) -> dict[str, ParameterShape]:
        """Every checkpoint parameter (the first worker's view: all hold the same names)."""
        result: dict[str, ParameterShape] = (await self._rpc(LAYOUT, ()))[0]
        return result

    async def checksums(self, names: list[str]) -> list[Checksum]:
        result: list[Checksum] = (await self._rpc(CHECKSUMS, (names,)))[0]
        return result

    async def join_group(self, group: Group) -> list[int]:
        """Joins every worker; returns their ranks."""
        return [int(rank) for rank in await self._rpc(JOIN_GROUP, (group,))]

    async def leave_group(self) -> None:
        await self._rpc(LEAVE_GROUP, ())

    async def receive_buckets(self, buckets: list[Bucket], check_finite: bool) -> list[Received]:
        results: list[Received] = await self._rpc(RECEIVE_BUCKETS, (buckets, check_finite))
        return results

    async def stage(self, params: list[StagedParameter]) -> list[str]:
        """Stages the parameters on every worker; returns the names whose patched bytes did
        not match their SHA-256 (nothing of the call is staged then)."""
        results = await self._rpc(STAGE, (params,))
        return sorted({str(name) for result in results for name in (result or [])})

    async def discard(self) -> int:
        """Drops staged parameters; returns how many there were."""
        return int((await self._rpc(DISCARD, ()))[0])

    async def commit(self) -> int:
        """Makes the staged parameters serve, keeping the previous weights for a rollback;
        returns how many were replaced."""
        return int((await self._rpc(COMMIT, ()))[0])

    async def rollback(self) -> int:
        """Serves the weights from before the last commit again; returns how many parameters
        were restored."""
        return int((await self._rpc(ROLLBACK, ()))[0])

    async def release_rollback(self) -> None:
        """Drops the weights kept for a rollback (their memory)."""
        await self._rpc(RELEASE_ROLLBACK, ())

    async def clear_kv_cache(self) -> int:
        """Zeroes the KV cache memory (only while no request holds KV); returns its bytes."""
        return int(sum(await self._rpc(CLEAR_KV_CACHE, ())))
