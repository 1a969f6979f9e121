"""Weight transfer on the server: ordering, validation, in-band assembly, commit.

``WeightTransferManager`` is the state machine behind the ControlPlane weight RPCs. It talks to
vLLM's workers only through an ``rpc(method, args)`` callable (``collective_rpc`` on the real
engine), so its rules are tested without an engine. An update is one transaction:
StartWeightUpdate, any number of UpdateWeights (collective) / PushWeights (in-band) calls, then
FinishWeightUpdate. Everything received is validated against the model's checkpoint layout
before it reaches a worker, staged there, and applied only by Finish. Any failure rejects the
whole update (staging is discarded, the serving weights never change) and says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

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

from .early_answer import read_rest

log = logging.getLogger(__name__)

Rpc = Callable[[str, tuple[Any, ...]], Awaitable[list[Any]]]
STAGE_BATCH_BYTES = 32 << 20  # bytes per collective_rpc when shipping in-band weights
DRAIN_SECONDS = 10.0  # how long a rejected push keeps reading before answering
BACKEND_NAMES = {cp.WEIGHT_TRANSFER_BACKEND_GLOO: "gloo", cp.WEIGHT_TRANSFER_BACKEND_NCCL: "nccl"}


@dataclass(frozen=True)
class ParamLayout:
    dtype: dtypes.DTypeInfo
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return dtypes.num_bytes(self.shape, self.dtype)


def check_parameter(spec: cp.ParameterSpec, layout: dict[str, ParamLayout]) -> ParamLayout:
    """The model's layout of ``spec.name``, if the spec matches it exactly."""
    expected = layout.get(spec.name)
    if expected is None:
        examples = ", ".join(sorted(layout)[:3])
        raise InvalidArgument(
            f"unknown parameter {spec.name!r}: the model has {len(layout)} parameters "
            f"(checkpoint names, e.g. {examples})"
        )
    sent = dtypes.from_proto(spec.dtype, f"dtype of {spec.name}")
    if sent.proto != expected.dtype.proto:
        raise InvalidArgument(
            f"dtype mismatch for {spec.name}: sent {sent.torch_name}, the model's is "
            f"{expected.dtype.torch_name}"
        )
    if tuple(spec.shape) != expected.shape:
        raise InvalidArgument(
            f"shape mismatch for {spec.name}: sent {list(spec.shape)}, the model's is "
            f"{list(expected.shape)}"
        )
    if spec.sha256 and len(spec.sha256) != 32:
        raise InvalidArgument(f"sha256 of {spec.name} has {len(spec.sha256)} bytes, not 32")
    return expected


@dataclass
class _Incoming:
    layout: ParamLayout
    sha256: bytes
    received: int = 0
    # The chunks as received (views into the received messages): the worker copies them into
    # the parameter's buffer, so joining them here would only add a pass over memory.
    chunks: list[bytes | memoryview] = field(default_factory=list)
    # Running SHA-256 of the chunks, when the manifest gave one to check.
    digest: Any = None

    def __post_init__(self) -> None:
        if self.sha256:
            self.digest = hashlib.sha256()


class InBandAssembler:
    """Reassembles one PushWeights stream: manifest first, then in-order checksummed chunks."""

    def __init__(self, layout: dict[str, ParamLayout]) -> None:
        self._layout = layout
        self._incoming: dict[str, _Incoming] | None = None
        self.bytes_received = 0

    def add(self, message: cp.PushWeightsRequest | WireChunk) -> None:
        """Takes the next message, as protobuf parsed it or as ``decode_push_request`` read it."""
        if isinstance(message, WireChunk):
            self._add_chunk(message)
            return
        kind = message.WhichOneof("item")
        if kind == "manifest":
            if self._incoming is not None:
                raise InvalidArgument("a second manifest in one PushWeights stream")
            self._incoming = {}
            for spec in message.manifest.parameters:
                if spec.name in self._incoming:
                    raise InvalidArgument(f"parameter {spec.name} is listed twice in the manifest")
                self._incoming[spec.name] = _Incoming(
                    check_parameter(spec, self._layout), spec.sha256
                )
            return
        if kind != "chunk":
            raise InvalidArgument("a PushWeights message must carry a manifest or a chunk")
        self._add_chunk(WireChunk.from_proto(message.chunk))

    def _add_chunk(self, chunk: WireChunk) -> None:
        if self._incoming is None:
            raise InvalidArgument("the first PushWeights message must be the manifest")
        incoming = self._incoming.get(chunk.name)
        if incoming is None:
            raise InvalidArgument(f"chunk for {chunk.name!r}, which the manifest does not list")
        data = chunk.data
        if chunk.offset_bytes != incoming.received:
            raise InvalidArgument(
                f"chunk of {chunk.name} at offset {chunk.offset_bytes}, expected "
                f"{incoming.received} (chunks of a parameter must arrive in order)"
            )
        end = incoming.received + len(data)
        if end > incoming.layout.num_bytes:
            raise InvalidArgument(
                f"chunks of {chunk.name} exceed its {incoming.layout.num_bytes} bytes"
            )
        if not chunk.sha256 and chunk.crc32 is None:
            raise InvalidArgument(
                f"the chunk of {chunk.name} at offset {chunk.offset_bytes} has no checksum: set "
                "crc32 (zlib.crc32 of data) or sha256"
            )
        if (chunk.crc32 is not None and zlib.crc32(data) != chunk.crc32) or (
            chunk.sha256 and hashlib.sha256(data).digest() != chunk.sha256
        ):
            raise DataLoss(
                f"checksum mismatch in the chunk of {chunk.name} at offset {chunk.offset_bytes}: "
                "the bytes were corrupted in transit"
            )
        incoming.chunks.append(data)
        if incoming.digest is not None:
            incoming.digest.update(data)
        incoming.received = end
        self.bytes_received += len(data)

    def finish(self) -> list[list[Any]]:
        """Checks the stream was complete; returns ``[name, dtype, shape, chunks]`` items (the
        parameter's bytes as the list of received chunks, in order)."""
        if self._incoming is None:
            raise InvalidArgument("the PushWeights stream was empty (no manifest)")
        items = []
        for name, incoming in self._incoming.items():
            expected = incoming.layout.num_bytes
            if incoming.received != expected:
                raise InvalidArgument(
                    f"the stream ended before {name} was complete ({incoming.received} of "
                    f"{expected} bytes): truncated push"
                )
            if incoming.digest is not None and incoming.digest.digest() != incoming.sha256:
                raise DataLoss(
                    f"checksum mismatch for {name}: the assembled bytes differ from the sender's"
                )
            layout = incoming.layout
            items.append([name, layout.dtype.torch_name, list(layout.shape), incoming.chunks])
        return items


def bucket_layout(bucket: cp.WeightBucket, layout: dict[str, ParamLayout]) -> dict[str, Any]:
    """A validated bucket as the worker receives it."""
    params = []
    spans = []
    for packed in bucket.parameters:
        expected = check_parameter(packed.parameter, layout)
        end = packed.offset_bytes + expected.num_bytes
        if end > bucket.size_bytes:
            raise InvalidArgument(
                f"{packed.parameter.name} spans bytes {packed.offset_bytes}..{end} of a "
                f"{bucket.size_bytes}-byte bucket"
            )
        spans.append((packed.offset_bytes, end, packed.parameter.name))
        params.append(
            {
                "name": packed.parameter.name,
                "dtype": expected.dtype.torch_name,
                "shape": list(expected.shape),
                "offset": packed.offset_bytes,
                "sha256": packed.parameter.sha256,
            }
        )
    spans.sort()
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise InvalidArgument(f"{name} and {other} overlap in a bucket")
    return {"size": bucket.size_bytes, "params": params}


class WeightTransferManager:
    """The weight-update transaction of one server."""

    def __init__(
        self,
        rpc: Rpc,
        set_version: Callable[[int], None],
        get_version: Callable[[], int],
        on_commit: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._rpc = rpc
        self._set_version = set_version
        self._get_version = get_version
        self._on_commit = on_commit
        self._layout: dict[str, ParamLayout] | None = None
        self.group_backend: str | None = None
        self.update_open = False
        self._staged: set[str] = set()
        self._lock = asyncio.Lock()

    async def layout(self) -> dict[str, ParamLayout]:
        if self._layout is None:
            raw: dict[str, list[Any]] = (await self._rpc("skyrl_layout", ()))[0]
            self._layout = {
                name: ParamLayout(dtypes.BY_TORCH[dtype], tuple(shape))
                for name, (dtype, shape) in raw.items()
            }
        return self._layout

    async def init(self, request: cp.InitWeightTransferRequest) -> None:
        backend = BACKEND_NAMES.get(request.backend)
        if backend is None:
            raise InvalidArgument(
                f"backend = {request.backend}: InitWeightTransfer takes GLOO (1) or NCCL (2); "
                "GRPC_STREAM needs no group: use PushWeights"
            )
        if not request.master_address or not 0 < request.master_port < 65536:
            raise InvalidArgument("master_address and master_port (1..65535) are required")
        if request.rank_offset < 1 or request.world_size <= request.rank_offset:
            raise InvalidArgument(
                f"rank_offset = {request.rank_offset}, world_size = {request.world_size}: "
                "rank 0 is the trainer, so rank_offset >= 1 and world_size > rank_offset"
            )
        async with self._lock:
            timeout = float(request.timeout_seconds or 300)
            try:
                await self._rpc(
                    "skyrl_join_group",
                    (
                        backend,
                        request.master_address,
                        request.master_port,
                        request.rank_offset,
                        request.world_size,
                        request.group_name or "default",
                        timeout,
                    ),
                )
            except Exception as exc:
                raise _transport_error("joining the weight-transfer group", exc) from exc
            self.group_backend = backend

    async def start(self) -> None:
        async with self._lock:
            if self.update_open:
                raise FailedPrecondition(
                    "a weight update is already open: finish it (FinishWeightUpdate) or cancel it "
                    "(CancelWeightUpdate) first"
                )
            await self.layout()
            await self._rpc("skyrl_discard", ())
            self._staged.clear()
            self.update_open = True

    def _require_open(self, what: str) -> None:
        if not self.update_open:
            raise FailedPrecondition(f"{what} before StartWeightUpdate: open an update first")

    async def update(self, request: cp.UpdateWeightsRequest) -> tuple[int, int]:
        async with self._lock:
            if self.group_backend is None:
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
                raw = [{"size": b.size_bytes, "params": []} for b in request.buckets]
                await self._abandon(self._rpc("skyrl_receive_buckets", (raw,)))
                raise
            try:
                results = await self._rpc("skyrl_receive_buckets", (buckets,))
            except Exception as exc:
                await self._abandon(None)
                self.group_backend = None  # a failed collective leaves the group unusable
                raise _transport_error("receiving weight buckets", exc) from exc
            mismatches = sorted({m for r in results for m in r["mismatches"]})
            if mismatches:
                await self._abandon(None)
                raise DataLoss(
                    f"checksum mismatch for {', '.join(mismatches)}: update rejected, the serving "
                    "weights are unchanged; start a new update"
                )
            self._staged.update(p["name"] for b in buckets for p in b["params"])
            return results[0]["params"], results[0]["bytes"]

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
                items = assembler.finish()
            except SkyrlError as error:
                await self._abandon(None)
                raise type(error)(
                    f"{error}; update rejected, the serving weights are unchanged"
                ) from error
            except asyncio.CancelledError:
                await self._abandon(None)  # the sender went away mid-stream
                raise
            batch: list[list[Any]] = []
            size = 0
            for item in items:
                batch.append(item)
                size += sum(len(chunk) for chunk in item[3])
                if size >= STAGE_BATCH_BYTES:
                    await self._rpc("skyrl_stage", (batch,))
                    batch, size = [], 0
            if batch:
                await self._rpc("skyrl_stage", (batch,))
            self._staged.update(item[0] for item in items)
            return len(items), assembler.bytes_received

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
                counts = await self._rpc("skyrl_commit", ())
            except Exception as exc:
                await self._abandon(None)
                raise _transport_error(
                    "applying the new weights (previous weights restored)", exc
                ) from exc
            self.update_open = False
            self._staged.clear()
            self._set_version(weight_version)
            if self._on_commit is not None:
                await self._on_commit()
            return weight_version, int(counts[0])

    async def cancel(self) -> int:
        async with self._lock:
            self._require_open("CancelWeightUpdate")
            discarded = (await self._rpc("skyrl_discard", ()))[0]
            self.update_open = False
            self._staged.clear()
            return int(discarded)

    async def checksums(self, names: list[str]) -> list[cp.ParameterChecksum]:
        layout = await self.layout()
        unknown = [n for n in names if n not in layout]
        if unknown:
            raise InvalidArgument(f"unknown parameter(s): {', '.join(unknown)}")
        rows = (await self._rpc("skyrl_checksums", (names,)))[0]
        return [
            cp.ParameterChecksum(
                name=name, sha256=digest, dtype=dtypes.BY_TORCH[dtype].proto, shape=shape
            )  # type: ignore[arg-type]
            for name, digest, dtype, shape in rows
        ]

    async def _abandon(self, pending: Awaitable[Any] | None) -> None:
        """Rejects the open update: staging dropped, the update closed."""
        try:
            if pending is not None:
                await pending
        finally:
            self._staged.clear()
            self.update_open = False
            try:
                await self._rpc("skyrl_discard", ())
            except Exception:
                log.exception("discarding staged weights failed")


def _transport_error(what: str, exc: Exception) -> SkyrlError:
    text = str(exc)
    if "timed out" in text.lower():
        return DeadlineExceeded(f"{what} timed out: {text}")
    return Unavailable(f"{what} failed: {text}")
