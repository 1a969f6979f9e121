"""Checking what a weight update carries against the model: parameter specs, in-band streams
(manifest, then in-order checksummed chunks) and collective bucket layouts.

Pure: no engine, no gRPC. ``transaction`` feeds these with what arrives and hands the results to
the workers; anything that does not match the model is rejected here, before a worker sees it.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any

from servers.engine.transfer.finite import FiniteCheck
from servers.engine.transfer.protocol import (
    Bucket,
    BucketParameter,
    ParameterShape,
    StagedParameter,
)
from servers.engine.transfer.specs import BucketSpec, Manifest, ParameterSpec
from skyrl_grpc import dtypes, patch_format
from skyrl_grpc.chunk_wire import WireChunk
from skyrl_grpc.crc import crc32
from skyrl_grpc.errors import DataLoss, FailedPrecondition, InvalidArgument


@dataclass(frozen=True)
class ParamLayout:
    dtype: dtypes.DTypeInfo
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return dtypes.num_bytes(self.shape, self.dtype)


def check_parameter(spec: ParameterSpec, layout: dict[str, ParamLayout]) -> ParamLayout:
    """The model's layout of ``spec.name``, if the spec matches it exactly (a patch too: its
    dtype and shape are those of the parameter it patches)."""
    expected = layout.get(spec.name)
    if expected is None:
        examples = ", ".join(sorted(layout)[:3])
        raise InvalidArgument(
            f"unknown parameter {spec.name!r}: the model has {len(layout)} parameters "
            f"(checkpoint names, e.g. {examples})"
        )
    sent = spec.dtype
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
    if spec.patch is not None:
        elements = dtypes.num_elements(expected.shape)
        if not 0 < spec.patch.changed <= elements:
            raise InvalidArgument(
                f"the patch of {spec.name} changes {spec.patch.changed} elements: it has "
                f"{elements} (send the whole parameter when nothing or everything changed)"
            )
        if elements >= 1 << 32 and not spec.patch.bitmap:
            raise InvalidArgument(
                f"{spec.name} is too large for a patch's uint32 indices: name its elements "
                "with a bitmap"
            )
        size = patch_bytes(expected, spec.patch.changed, spec.patch.bitmap)
        if spec.patch.zstd_bytes > size:
            raise InvalidArgument(
                f"the compressed patch of {spec.name} is {spec.patch.zstd_bytes} bytes, more "
                f"than the {size} it holds: send it uncompressed (zstd_bytes = 0)"
            )
    return expected


def patch_bytes(layout: ParamLayout, changed: int, bitmap: bool) -> int:
    """Bytes of a patch of ``changed`` elements on the wire (``patch_format``)."""
    elements = dtypes.num_elements(layout.shape)
    return patch_format.patch_bytes(elements, layout.dtype.itemsize, changed, bitmap)


def decompressed(name: str, layout: ParamLayout, frame: Any, changed: int, bitmap: bool) -> Any:
    """The patch a compressed patch's zstd ``frame`` holds (``patch_format.decompress``: its
    values XORs with the serving ones), checked as ``check_patch`` checks a patch."""
    elements = dtypes.num_elements(layout.shape)
    try:
        payload = patch_format.decompress(frame, elements, layout.dtype.itemsize, changed, bitmap)
    except ValueError as error:
        raise InvalidArgument(f"the compressed patch of {name}: {error}") from None
    check_patch(name, elements, payload, changed, bitmap)
    return payload


def check_patch(name: str, elements: int, payload: Any, changed: int, bitmap: bool) -> None:
    """The patch names exactly ``changed`` elements inside the parameter (of ``elements``),
    indices strictly increasing; ``payload``: the patch's bytes (anything holding a buffer)."""
    import numpy as np

    if bitmap:
        problem = patch_format.bitmap_problem(payload, elements, changed)
        if problem:
            raise InvalidArgument(f"the patch of {name}: {problem}")
        return
    indices = np.frombuffer(payload, dtype="<u4", count=changed)
    if changed and int(indices[-1]) >= elements:
        raise InvalidArgument(
            f"the patch of {name} names element {int(indices[-1])}; it has {elements}"
        )
    if changed > 1 and not bool(np.all(indices[1:] > indices[:-1])):
        raise InvalidArgument(f"the patch of {name}: indices must be strictly increasing")


NON_FINITE_FLAG = "--allow-non-finite-weights"


def non_finite_error(name: str) -> InvalidArgument:
    return InvalidArgument(
        f"{name} holds a NaN or an infinity: weights must be finite (a non-finite value "
        f"poisons every generation); fix the trainer's weights, or start the server with "
        f"{NON_FINITE_FLAG} to accept them"
    )


@dataclass
class _Incoming:
    layout: ParamLayout
    sha256: bytes
    # A patch: elements changed and the version it applies to (0 / 0: the whole value).
    patch_changed: int = 0
    patch_base: int = 0
    # A patch naming its elements with a bitmap (``patch_format``), not indices.
    patch_bitmap: bool = False
    # A compressed patch: the bytes of its zstd frame (0: not compressed).
    patch_zstd: int = 0
    received: int = 0
    # Bytes already handed to the workers (``take_ready``): the chunks start there.
    taken: int = 0
    # The chunks as received and not yet handed over (views into the received messages): the
    # worker copies them into the parameter's buffer, so joining them here would only add a
    # pass over memory.
    chunks: list[bytes | memoryview] = field(default_factory=list)
    # Running SHA-256 of the chunks, when the manifest gave one to check.
    digest: Any = None
    # Checks values as chunks arrive.
    finite: FiniteCheck = field(init=False)

    def __post_init__(self) -> None:
        if self.sha256 and not self.patch_changed:  # a patch's digest is of the patched bytes
            self.digest = hashlib.sha256()
        self.finite = FiniteCheck(self.layout.dtype.torch_name, self.layout.dtype.itemsize)

    @property
    def expected_bytes(self) -> int:
        if self.patch_zstd:
            return self.patch_zstd
        if self.patch_changed:
            return patch_bytes(self.layout, self.patch_changed, self.patch_bitmap)
        return self.layout.num_bytes


class InBandAssembler:
    """Reassembles one PushWeights stream: manifest first, then in-order checksummed chunks.

    Values are checked as they arrive: unless ``allow_non_finite``, a chunk holding a NaN or
    infinity rejects the stream, naming the first parameter where one arrived; with it, the
    parameters are recorded in ``non_finite``.
    """

    def __init__(self, layout: dict[str, ParamLayout], allow_non_finite: bool = False) -> None:
        self._layout = layout
        self._allow_non_finite = allow_non_finite
        self.non_finite: list[str] = []
        self._incoming: dict[str, _Incoming] | None = None
        self.bytes_received = 0
        # Parameters with bytes ready for the workers (``take_ready``), in arrival order: whole
        # values as their chunks arrive, patches once complete and checked.
        self._ready: dict[str, None] = {}
        self._taken: set[str] = set()

    def add(self, message: Manifest | WireChunk) -> None:
        """Takes the stream's next item: its manifest (first), then its chunks."""
        if isinstance(message, WireChunk):
            self._add_chunk(message)
            return
        if self._incoming is not None:
            raise InvalidArgument("a second manifest in one PushWeights stream")
        self._incoming = {}
        for spec in message.parameters:
            if spec.name in self._incoming:
                raise InvalidArgument(f"parameter {spec.name} is listed twice in the manifest")
            patch = spec.patch
            self._incoming[spec.name] = _Incoming(
                check_parameter(spec, self._layout),
                spec.sha256,
                patch_changed=patch.changed if patch else 0,
                patch_base=patch.base_weight_version if patch else 0,
                patch_bitmap=bool(patch and patch.bitmap),
                patch_zstd=patch.zstd_bytes if patch else 0,
            )

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
        if end > incoming.expected_bytes:
            raise InvalidArgument(
                f"chunks of {chunk.name} exceed its {incoming.expected_bytes} bytes"
            )
        if not chunk.sha256 and chunk.crc32 is None:
            raise InvalidArgument(
                f"the chunk of {chunk.name} at offset {chunk.offset_bytes} has no checksum: set "
                "crc32 (zlib.crc32 of data) or sha256"
            )
        if (chunk.crc32 is not None and crc32(data) != chunk.crc32) or (
            chunk.sha256 and hashlib.sha256(data).digest() != chunk.sha256
        ):
            raise DataLoss(
                f"checksum mismatch in the chunk of {chunk.name} at offset {chunk.offset_bytes}: "
                "the bytes were corrupted in transit"
            )
        # A patch's values follow its indices: checked once it is complete.
        if not incoming.patch_changed and incoming.finite.finite and not incoming.finite.add(data):
            self._non_finite(chunk.name)
        incoming.chunks.append(data)
        if incoming.digest is not None:
            incoming.digest.update(data)
        incoming.received = end
        self.bytes_received += len(data)
        if end == incoming.expected_bytes:
            self._check_digest(chunk.name, incoming)
            if incoming.patch_changed:
                self._check_patch(chunk.name, incoming)
                self._ready[chunk.name] = None
        if not incoming.patch_changed:
            self._ready[chunk.name] = None

    def _non_finite(self, name: str) -> None:
        if not self._allow_non_finite:
            raise non_finite_error(name)
        self.non_finite.append(name)

    def _check_patch(self, name: str, incoming: _Incoming) -> None:
        payload = b"".join(incoming.chunks)
        elements = dtypes.num_elements(incoming.layout.shape)
        changed, bitmap = incoming.patch_changed, incoming.patch_bitmap
        if incoming.patch_zstd:
            # Its values are XORs: the worker checks them once applied.
            incoming.chunks = [decompressed(name, incoming.layout, payload, changed, bitmap)]
            return
        incoming.chunks = [payload]
        check_patch(name, elements, payload, changed, bitmap)
        values = memoryview(payload)[patch_format.names_bytes(elements, changed, bitmap) :]
        if not incoming.finite.add(values):
            self._non_finite(name)

    @property
    def patch_bases(self) -> dict[str, int]:
        """The version each patch of the manifest applies to (empty before the manifest)."""
        incoming = self._incoming or {}
        return {n: i.patch_base for n, i in incoming.items() if i.patch_changed}

    @property
    def ready_bytes(self) -> int:
        """Bytes ready for the workers and not yet taken, as the workers get them: a compressed
        patch decompressed (3-5x its frame), so a batch holds what its size says."""
        incoming = self._incoming or {}
        return sum(len(chunk) for n in self._ready for chunk in incoming[n].chunks)

    def take_ready(self) -> list[StagedParameter]:
        """The bytes ready since the last call, handed over: whole values in pieces as they
        arrived (a large parameter need not be complete to start reaching the workers),
        patches whole. The assembler drops its references to them, so neither a stream nor a
        large parameter is ever held whole."""
        assert self._incoming is not None or not self._ready
        taken = [self._staged(name) for name in self._ready]
        for name in self._ready:
            incoming = self._incoming[name]  # type: ignore[index]
            incoming.taken = incoming.received
            incoming.chunks = []
            if incoming.received == incoming.expected_bytes:
                self._taken.add(name)
        self._ready = {}
        return taken

    @staticmethod
    def _check_digest(name: str, incoming: _Incoming) -> None:
        if incoming.digest is not None and incoming.digest.digest() != incoming.sha256:
            raise DataLoss(
                f"checksum mismatch for {name}: the assembled bytes differ from the sender's"
            )

    def _staged(self, name: str) -> StagedParameter:
        assert self._incoming is not None
        incoming = self._incoming[name]
        layout = incoming.layout
        staged = StagedParameter(
            name=name,
            dtype=layout.dtype.torch_name,
            shape=list(layout.shape),
            offset=incoming.taken,
            chunks=incoming.chunks,
            last=incoming.received == incoming.expected_bytes,
            patch=incoming.patch_changed,
            bitmap=incoming.patch_bitmap,
            sha256=incoming.sha256 if incoming.patch_changed else b"",
        )
        if incoming.patch_zstd:
            staged["xor"] = True
        return staged

    def finish(self) -> list[StagedParameter]:
        """Checks the stream was complete; returns what was not taken yet (``take_ready``)."""
        if self._incoming is None:
            raise InvalidArgument("the PushWeights stream was empty (no manifest)")
        for name, incoming in self._incoming.items():
            expected = incoming.expected_bytes
            if incoming.received != expected:
                raise InvalidArgument(
                    f"the stream ended before {name} was complete ({incoming.received} of "
                    f"{expected} bytes): truncated push"
                )
            if expected == 0 and name not in self._taken:
                self._ready[name] = None  # an empty tensor, which no chunk completed
        return self.take_ready()


def bucket_layout(bucket: BucketSpec, layout: dict[str, ParamLayout]) -> Bucket:
    """A validated bucket as the worker receives it."""
    params: list[BucketParameter] = []
    spans = []
    for packed in bucket.parameters:
        spec = packed.parameter
        expected = check_parameter(spec, layout)
        changed = spec.patch.changed if spec.patch else 0
        bitmap = bool(spec.patch and spec.patch.bitmap)
        zstd = spec.patch.zstd_bytes if spec.patch and changed else 0
        size = zstd or (patch_bytes(expected, changed, bitmap) if changed else expected.num_bytes)
        end = packed.offset_bytes + size
        if end > bucket.size_bytes:
            raise InvalidArgument(
                f"{packed.parameter.name} spans bytes {packed.offset_bytes}..{end} of a "
                f"{bucket.size_bytes}-byte bucket"
            )
        spans.append((packed.offset_bytes, end, packed.parameter.name))
        param = BucketParameter(
            name=packed.parameter.name,
            dtype=expected.dtype.torch_name,
            shape=list(expected.shape),
            offset=packed.offset_bytes,
            sha256=packed.parameter.sha256,
            patch=changed,
            bitmap=bitmap,
        )
        if zstd:
            param["zstd"] = zstd
        params.append(param)
    spans.sort()
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise InvalidArgument(f"{name} and {other} overlap in a bucket")
    return Bucket(size=bucket.size_bytes, params=params)


def bucket_patch_bases(buckets: list[BucketSpec]) -> dict[str, int]:
    """The version each patch in the buckets applies to, by parameter."""
    return {
        packed.parameter.name: packed.parameter.patch.base_weight_version
        for bucket in buckets
        for packed in bucket.parameters
        if packed.parameter.patch is not None
    }


def model_layout(shapes: dict[str, ParameterShape]) -> dict[str, ParamLayout]:
    """The workers' parameter shapes as layouts."""
    return {
        name: ParamLayout(dtypes.BY_TORCH[shape["dtype"]], tuple(shape["shape"]))
        for name, shape in shapes.items()
    }


class PatchBaseMismatch(FailedPrecondition):
    """Patches for a version this server does not serve: refused before anything is staged,
    leaving the update open for the whole weights."""


def check_patch_bases(bases: dict[str, int], serving: int) -> None:
    """Raises ``PatchBaseMismatch`` unless every patch applies to the ``serving`` version."""
    wrong = sorted(name for name, base in bases.items() if base != serving)
    if wrong:
        raise PatchBaseMismatch(
            f"{len(wrong)} patches (e.g. {wrong[0]}) apply to version {bases[wrong[0]]}, "
            f"but this server serves version {serving}: send the whole parameters (the "
            "update stays open, nothing was staged)"
        )


def check_stream_bases(bases: dict[str, int], serving: int, first: bool) -> None:
    """A manifest's patches must fit the ``serving`` version: the first manifest of a stream
    is refused with nothing staged (``PatchBaseMismatch``: the update stays open for the whole
    weights); a later one rejects the update (what the stream staged before it goes with it)."""
    try:
        check_patch_bases(bases, serving)
    except PatchBaseMismatch as error:
        if first:
            raise
        raise FailedPrecondition(str(error)) from None
