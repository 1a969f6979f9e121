"""What a worker does with the bytes of an update (``transfer_engine``): broadcast buckets
received and checked (``receive_buckets``), in-band pieces copied into place (``copy_into``),
patches applied to the checkpoint-format copy (``apply_patch``), both staged (``stage``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypedDict

import torch

from servers.engine.transfer.assembly import ParamLayout, check_patch, decompressed
from servers.engine.transfer.finite import all_finite
from servers.engine.transfer.protocol import Bucket, BucketParameter, StagedParameter
from servers.engine.worker.checkpoint import ServingCheckpoint, bits_of
from skyrl_grpc import dtypes, patch_format
from skyrl_grpc.dtypes import num_elements
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.tensor_bytes import sha256_of


def copy_into(tensor: torch.Tensor, offset: int, chunks: list[bytes | memoryview]) -> None:
    """Writes ``chunks`` into ``tensor``'s bytes from ``offset`` on."""
    import numpy as np

    raw: Any = tensor.view(-1).view(torch.uint8).numpy()
    for chunk in chunks:
        data = np.frombuffer(chunk, dtype=np.uint8)
        raw[offset : offset + data.size] = data
        offset += data.size


def apply_patch(
    serving: ServingCheckpoint, param: StagedParameter | BucketParameter, payload: Any
) -> tuple[Any, bool]:
    """Applies ``param``'s patch (``payload``: the changed elements' names, then their values,
    as ``skyrl_grpc.patch_format`` lays them out, XORs for a patch that came compressed; bytes
    or a uint8 array); returns the patched tensor and whether the values it wrote are finite
    (checked here only for XORs: other values were checked on arrival)."""
    import numpy as np

    changed = int(param["patch"])
    bitmap = bool(param.get("bitmap", False))
    xor = bool(param.get("xor", False) or param.get("zstd", 0))
    dtype = getattr(torch, param["dtype"])
    raw = np.frombuffer(payload, dtype=np.uint8)
    elements = num_elements(param["shape"])
    start = patch_format.names_bytes(elements, changed, bitmap)
    integers = dtypes.BITS_BY_ITEMSIZE[dtype.itemsize]
    values = raw[start : start + changed * dtype.itemsize].view(integers)
    tensor, indices = serving.patch(param["name"], raw[:start], bitmap, values, xor=xor)
    if not xor:
        return tensor, True
    written = np.take(tensor.view(-1).view(bits_of(dtype.itemsize)).numpy(), indices)
    return tensor, all_finite(written.data, param["dtype"])


class Staged(TypedDict):
    """What ``stage`` did: the parameters it completed, and those refused or flagged."""

    completed: list[str]
    mismatches: list[str]
    non_finite: list[str]


def stage(
    serving: ServingCheckpoint,
    params: list[StagedParameter],
    region_view: Callable[[Any], memoryview],
) -> Staged:
    """Stages in-band parameters (verified by the server; those with a ``region`` lie in the
    server's handoff buffer, read through ``region_view``). A patch is applied to the serving
    copy in place (bit for bit, as integers; what it overwrote recorded) and checked against
    its SHA-256 when it carries one; on a mismatch nothing of the call stays staged."""
    mark = serving.mark()
    mismatches: list[str] = []
    non_finite: list[str] = []
    for param in params:
        dtype = getattr(torch, param["dtype"])
        region = param.get("region")
        chunks: list[bytes | memoryview] = [region_view(region)] if region else param["chunks"]
        if param.get("patch"):
            payload = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            tensor, finite = apply_patch(serving, param, payload)
            if not finite:
                non_finite.append(param["name"])
            expected = param.get("sha256", b"")
            if expected and sha256_of(tensor) != expected:
                mismatches.append(param["name"])
            continue
        # A whole value, possibly in pieces: one copy, into a tensor made at its first.
        if param["offset"] == 0:
            buffer = serving.buffer_for(param["name"], param["shape"], dtype)
            serving.stage_whole(param["name"], buffer)
        copy_into(serving.staged_whole(param["name"]), param["offset"], chunks)
    if mismatches:
        serving.revert_to(mark)
    completed = [param["name"] for param in params if param["last"]]
    return Staged(completed=completed, mismatches=mismatches, non_finite=non_finite)


@dataclass
class Received:
    """What ``receive_buckets`` took from the broadcasts."""

    # Whole parameters as host tensors (views of their bucket: each bucket has a buffer of its
    # own, so no copy), and patches as their bytes (indices, then values).
    whole: dict[str, Any] = field(default_factory=dict)
    patches: list[tuple[BucketParameter, Any]] = field(default_factory=list)
    bytes: int = 0
    # Parameters whose SHA-256 did not match (whole ones; a patch's is checked once applied),
    # that hold a non-finite value, or patches that do not fit their parameter (why).
    mismatches: list[str] = field(default_factory=list)
    non_finite: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)


def receive_buckets(
    group: Any,
    buckets: list[Bucket],
    timeout_seconds: float,
    check_finite: bool = False,
    buffer: Callable[[int, Bucket], Any] | None = None,
) -> Received:
    """Receives ``buckets`` from rank 0 of ``group`` and checks each parameter. The receive of
    the next bucket is posted before the current one is sliced and verified, so checking
    overlaps the transfer.
    ``buffer(index, bucket)``: the uint8 tensor to receive a bucket into (default: a new one,
    on the accelerator when there is one).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    timeout = timedelta(seconds=timeout_seconds)

    def post(index: int) -> tuple[Any, Any]:
        bucket = buckets[index]
        if buffer is not None:
            target = buffer(index, bucket)
        else:
            target = torch.empty(int(bucket["size"]), dtype=torch.uint8, device=device)
        return target, group.broadcast(target, 0)

    received = Received()
    pending = post(0) if buckets else None
    for index, bucket in enumerate(buckets):
        assert pending is not None
        target, work = pending
        work.wait(timeout)
        pending = post(index + 1) if index + 1 < len(buckets) else None
        host = target.cpu()
        received.bytes += host.numel()
        for param in bucket["params"]:
            _check_received(param, host, check_finite, received)
    return received


def _check_received(
    param: BucketParameter, host: Any, check_finite: bool, received: Received
) -> None:
    """Checks one parameter's bytes in a received bucket and keeps them."""
    name = param["name"]
    start = int(param["offset"])
    dtype = getattr(torch, param["dtype"])
    elements = num_elements(param["shape"])
    changed = int(param.get("patch", 0))
    zstd = int(param.get("zstd", 0))
    if zstd:
        # Its values are XORs with the serving ones: checked once applied (``_receive``).
        try:
            layout = ParamLayout(dtypes.BY_TORCH[param["dtype"]], tuple(param["shape"]))
            frame = host[start : start + zstd].numpy()
            raw = decompressed(name, layout, frame, changed, bool(param.get("bitmap", False)))
        except InvalidArgument as error:
            received.invalid.append(str(error))
            return
        received.patches.append((param, raw))
        return
    if changed:
        bitmap = bool(param.get("bitmap", False))
        size = patch_format.patch_bytes(elements, dtype.itemsize, changed, bitmap)
        raw = host[start : start + size]
        try:
            check_patch(name, elements, raw.numpy(), changed, bitmap)
        except InvalidArgument as error:
            received.invalid.append(str(error))
            return
        values = raw[patch_format.names_bytes(elements, changed, bitmap) :]
    else:
        raw = host[start : start + elements * dtype.itemsize]
        if param.get("sha256") and sha256_of(raw) != param["sha256"]:
            received.mismatches.append(name)
            return
        values = raw
    if check_finite and not all_finite(values.numpy(), param["dtype"]):
        received.non_finite.append(name)  # kept: the server decides (``_receive``)
    if changed:
        received.patches.append((param, raw.numpy()))
    else:
        received.whole[name] = raw.view(dtype).reshape(param["shape"])
