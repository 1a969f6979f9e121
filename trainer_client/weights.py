"""The trainer side of weight transfer: packing, chunking, and rank 0 of the process group.

Takes any iterable of ``(name, tensor)`` (e.g. ``model.state_dict().items()``). The collective
path packs tensors into buckets (one broadcast each); the in-band path cuts each tensor into
checksummed chunks after a manifest, serialized once and streamed to every server.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from skyrl_grpc import dtypes
from skyrl_grpc.process_group import join_group
from skyrl_grpc.v1 import control_plane_pb2 as cp

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_CHUNK_BYTES = 4 << 20


def raw_bytes(tensor: Any) -> Any:
    """A tensor's bytes as a flat uint8 CPU tensor (no copy when already contiguous on CPU)."""
    import torch

    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def sha256_of(tensor: Any) -> bytes:
    return hashlib.sha256(raw_bytes(tensor).numpy()).digest()


def parameter_spec(name: str, tensor: Any, with_checksum: bool) -> cp.ParameterSpec:
    return cp.ParameterSpec(
        name=name,
        dtype=dtypes.from_torch(tensor.dtype).proto,  # type: ignore[arg-type]
        shape=list(tensor.shape),
        sha256=sha256_of(tensor) if with_checksum else b"",
    )


@dataclass
class Bucket:
    """Tensors packed back to back; ``layout`` tells the servers where each one lies."""

    layout: cp.WeightBucket
    tensors: list[tuple[str, Any]]

    def pack(self, into: Any = None) -> Any:
        """The bucket's bytes, written into ``into`` (a uint8 tensor at least that large) when
        given: reusing one buffer avoids touching fresh memory for every bucket."""
        import torch

        if into is None:
            buffer = torch.empty(self.layout.size_bytes, dtype=torch.uint8)
        else:
            buffer = into[: self.layout.size_bytes]
        for packed, (_, tensor) in zip(self.layout.parameters, self.tensors, strict=True):
            data = raw_bytes(tensor)
            buffer[packed.offset_bytes : packed.offset_bytes + data.numel()].copy_(data)
        return buffer


def plan_buckets(
    named_tensors: Iterable[tuple[str, Any]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    with_checksums: bool = True,
) -> list[Bucket]:
    """Groups tensors into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    buckets: list[Bucket] = []
    current = Bucket(cp.WeightBucket(), [])
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if current.tensors and current.layout.size_bytes + size > bucket_bytes:
            buckets.append(current)
            current = Bucket(cp.WeightBucket(), [])
        current.layout.parameters.add(
            parameter=parameter_spec(name, tensor, with_checksums),
            offset_bytes=current.layout.size_bytes,
        )
        current.layout.size_bytes += size
        current.tensors.append((name, tensor))
    if current.tensors:
        buckets.append(current)
    return buckets


def push_messages(
    named_tensors: Iterable[tuple[str, Any]],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    with_checksums: bool = True,
) -> list[bytes]:
    """The serialized PushWeights stream: manifest, then every tensor in checksummed chunks."""
    tensors = list(named_tensors)
    manifest = cp.WeightManifest(
        parameters=[parameter_spec(n, t, with_checksums) for n, t in tensors]
    )
    messages = [cp.PushWeightsRequest(manifest=manifest).SerializeToString()]
    for name, tensor in tensors:
        data = raw_bytes(tensor).numpy()
        for offset in range(0, max(len(data), 1), chunk_bytes):
            piece = memoryview(data[offset : offset + chunk_bytes])
            messages.append(chunk_message(name, offset, piece))
    return messages


_CHUNK_FIELD = cp.PushWeightsRequest.DESCRIPTOR.fields_by_name["chunk"].number
_DATA_FIELD = cp.WeightChunk.DESCRIPTOR.fields_by_name["data"].number


def chunk_message(name: str, offset: int, piece: memoryview) -> bytes:
    """A serialized ``PushWeightsRequest`` carrying one chunk, copying ``piece`` only once.

    Building it through protobuf copies the data three times (to bytes, into the message, out
    to the wire), which made preparing the stream slower than sending it. The small fields are
    serialized by protobuf; the data field is appended in wire format (fields may come in any
    order), straight from the tensor's memory.
    """
    head = cp.WeightChunk(name=name, offset_bytes=offset, crc32=zlib.crc32(piece))
    head_bytes = head.SerializeToString()
    data_prefix = _field_prefix(_DATA_FIELD, len(piece))
    inner_length = len(head_bytes) + len(data_prefix) + len(piece)
    return b"".join((_field_prefix(_CHUNK_FIELD, inner_length), head_bytes, data_prefix, piece))


def _field_prefix(number: int, length: int) -> bytes:
    """Tag and length of a length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(length)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class CollectiveSender:
    """Rank 0 of the weight-transfer group; lives in the trainer process."""

    def __init__(
        self,
        backend: str,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        timeout_seconds: float,
    ) -> None:
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.world_size = world_size
        self.group_name = group_name
        self.timeout_seconds = timeout_seconds
        self._group: Any = None
        # The bucket staging buffer, kept across updates: memory touched for the first time
        # costs page faults that can take longer than the broadcast itself.
        self._scratch: Any = None

    def join(self) -> None:
        """Blocks until every server worker has joined (run it concurrently with their init)."""
        self._group = join_group(
            self.backend,
            self.master_address,
            self.master_port,
            0,
            self.world_size,
            self.group_name,
            self.timeout_seconds,
        )

    def broadcast(self, buckets: list[Bucket]) -> int:
        """Broadcasts each packed bucket in order; returns the bytes sent."""
        from datetime import timedelta

        import torch

        if self._group is None:
            raise RuntimeError("join() first")
        sent = 0
        device = "cuda" if self.backend == "nccl" else "cpu"
        # One staging buffer for every bucket: broadcast() completes before the next pack.
        largest = max((b.layout.size_bytes for b in buckets), default=0)
        if self._scratch is None or self._scratch.numel() < largest:
            self._scratch = torch.empty(largest, dtype=torch.uint8)
        for bucket in buckets:
            buffer = bucket.pack(into=self._scratch)
            if device != "cpu":
                buffer = buffer.to(device)
            self._group.broadcast(buffer, 0).wait(timedelta(seconds=self.timeout_seconds))
            sent += buffer.numel()
        if device != "cpu":
            torch.cuda.synchronize()
        return sent


def rank_offsets(world_sizes: list[int]) -> tuple[list[int], int]:
    """Each server's first rank (the trainer is rank 0) and the group's world size."""
    offsets = []
    next_rank = 1
    for size in world_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets, next_rank
