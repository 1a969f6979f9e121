"""The trainer side of weight transfer: packing, chunking, and rank 0 of the process group.

Takes any iterable of ``(name, tensor)`` (e.g. ``model.state_dict().items()``). The collective
path packs tensors into buckets (one broadcast each); the in-band path cuts each tensor into
checksummed chunks after a manifest, serialized once and streamed to every server.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from skyrl_grpc import dtypes
from skyrl_grpc.chunk_wire import chunk_head
from skyrl_grpc.crc import crc32
from skyrl_grpc.process_group import join_group, master_store
from skyrl_grpc.tensor_bytes import flat_bytes, sha256_of
from skyrl_grpc.v1 import control_plane_pb2 as cp

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_CHUNK_BYTES = 4 << 20
# A tensor at least this large is broadcast from its own memory instead of being copied into a
# bucket: on two cores that copy was a third of the work (the kernel's send and receive copies
# are the rest), while one more broadcast costs well under a millisecond.
DEFAULT_DIRECT_BYTES = 4 << 20


def parameter_spec(name: str, tensor: Any, with_checksum: bool) -> cp.ParameterSpec:
    return cp.ParameterSpec(
        name=name,
        dtype=dtypes.from_torch(tensor.dtype).proto,
        shape=list(tensor.shape),
        sha256=sha256_of(tensor) if with_checksum else b"",
    )


# A parameter as it travels: its spec and its bytes (a flat uint8 tensor, on the tensor's own
# device): the whole value, or a patch (``weight_patches``).
Entry = tuple[cp.ParameterSpec, Any]


@dataclass
class PackedBucket:
    """Entries' bytes packed back to back; ``layout`` tells the servers where each one lies.

    A ``direct`` bucket holds one large entry and is sent from that entry's own memory.
    """

    layout: cp.WeightBucket
    parts: list[Any]  # each entry's bytes, in the layout's order
    direct: bool = False

    def pack(self, into: Any = None) -> Any:
        """The bucket's bytes, written into ``into`` (a uint8 tensor at least that large) when
        given: reusing one buffer avoids touching fresh memory for every bucket. A direct
        bucket returns its entry's own bytes and ignores ``into``."""
        import torch

        if self.direct:
            return self.parts[0]
        if into is None:
            buffer = torch.empty(self.layout.size_bytes, dtype=torch.uint8)
        else:
            buffer = into[: self.layout.size_bytes]
        for packed, data in zip(self.layout.parameters, self.parts, strict=True):
            # copy_ crosses devices when the buffer is elsewhere
            buffer[packed.offset_bytes : packed.offset_bytes + data.numel()].copy_(data)
        return buffer


def whole_entry(name: str, tensor: Any, with_checksum: bool) -> Entry:
    """One tensor whole, its bytes on its own device (a view when contiguous)."""
    return parameter_spec(name, tensor, with_checksum), flat_bytes(tensor)


def tensor_entries(
    named_tensors: Iterable[tuple[str, Any]], with_checksums: bool = True
) -> list[Entry]:
    """Every tensor whole."""
    return [whole_entry(name, tensor, with_checksums) for name, tensor in named_tensors]


def plan_buckets(
    entries: Iterable[Entry],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    direct_bytes: int = DEFAULT_DIRECT_BYTES,
) -> list[PackedBucket]:
    """Groups entries into buckets of at most ``bucket_bytes``; an entry of ``direct_bytes`` or
    more (or larger than a bucket) gets a direct bucket of its own."""
    buckets: list[PackedBucket] = []
    current = PackedBucket(cp.WeightBucket(), [])
    for spec, data in entries:
        size = data.numel()
        if size >= min(direct_bytes, bucket_bytes):
            layout = cp.WeightBucket(size_bytes=size)
            layout.parameters.add(parameter=spec, offset_bytes=0)
            buckets.append(PackedBucket(layout, [data], direct=True))
            continue
        if current.parts and current.layout.size_bytes + size > bucket_bytes:
            buckets.append(current)
            current = PackedBucket(cp.WeightBucket(), [])
        current.layout.parameters.add(parameter=spec, offset_bytes=current.layout.size_bytes)
        current.layout.size_bytes += size
        current.parts.append(data)
    if current.parts:
        buckets.append(current)
    return buckets


def host_array(data: Any) -> Any:
    """Bytes as a host numpy array (no copy for a CPU tensor or an array)."""
    return data.cpu().numpy() if hasattr(data, "cpu") else data


def cuda_bytes(named_tensors: Iterable[tuple[str, Any]]) -> int:
    """The bytes of the CUDA tensors among ``named_tensors`` (what ``HostStaging`` takes)."""
    return sum(t.numel() * t.element_size() for _, t in named_tensors if getattr(t, "is_cuda", 0))


# Page-locked host memory a client keeps for the in-band bytes of CUDA tensors, at most: what
# does not fit goes through ordinary memory, as before.
PINNED_LIMIT_BYTES = 4 << 30


class HostStaging:
    """Page-locked host memory that CUDA tensors' bytes are copied into before they are
    streamed, kept by the client from one update to the next. Measured on an H200 with the
    0.3B benchmark model's 1.17 GB of float32 weights (``scripts/bench_gpu_trainer.py``):
    copying them to ordinary host memory (``.cpu()``) took 0.50-1.36 s and into page-locked
    memory allocated once 0.022 s; a whole stream from CUDA tensors took 1.12-1.59 s through
    ordinary memory, 0.43-0.50 s through this, and 0.37-0.44 s from host memory.

    ``reset(total)`` starts an update: what it stages goes from the buffer's start again (the
    previous update's streams are done), and the buffer grows to ``total`` (at most
    ``limit``). ``to_host`` copies a group's CUDA tensors in and returns host arrays of their
    bytes (CPU tensors and arrays as they are; what does not fit through ordinary memory)."""

    def __init__(self, limit: int = PINNED_LIMIT_BYTES) -> None:
        self._limit = limit
        self._buffer: Any = None
        self._used = 0
        self._copying = 0  # groups being copied in right now (worker threads)
        self._idle = threading.Condition()

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else int(self._buffer.numel())

    def reset(self, total: int) -> None:
        import torch

        with self._idle:
            # A group still being copied (prepared ahead for an update given up) finishes first.
            self._idle.wait_for(lambda: self._copying == 0)
            self._used = 0
            wanted = min(total, self._limit)
            if wanted > self.capacity:
                self._buffer = None  # freed before the larger one is pinned
                self._buffer = torch.empty(wanted, dtype=torch.uint8, pin_memory=True)

    def to_host(self, datas: list[Any]) -> list[Any]:
        import torch

        regions: list[Any] = []
        with self._idle:
            self._copying += 1
            for data in datas:
                size = int(data.numel()) if getattr(data, "is_cuda", False) else 0
                if size and self._buffer is not None and self._used + size <= self.capacity:
                    regions.append(self._buffer[self._used : self._used + size])
                    self._used += size
                else:
                    regions.append(None)
        try:
            devices = set()
            hosts = []
            for data, region in zip(datas, regions, strict=True):
                if region is None:
                    hosts.append(host_array(data))
                    continue
                region.copy_(data, non_blocking=True)
                devices.add(data.device)
                hosts.append(region.numpy())
            for device in devices:
                torch.cuda.synchronize(device)  # the copies were queued on its stream
            return hosts
        finally:
            with self._idle:
                self._copying -= 1
                self._idle.notify_all()


class PushStream:
    """A PushWeights stream made as it is sent: the manifest, then every parameter's bytes in
    checksummed chunks. Checksums are computed once, up front (SHA-256 per tensor when asked,
    CRC-32 per chunk: a few bytes each); each iteration then serializes one chunk at a time
    from the tensors' own memory, so sending to several servers never holds a serialized copy
    of the model (each message is one chunk, copied once into it).

    ``entries``: each parameter's spec and bytes (a flat uint8 tensor, moved to the host here,
    through ``staging``'s page-locked memory when given, or array); ``tensor_entries`` and
    ``weight_patches`` make them."""

    def __init__(
        self,
        entries: list[Entry],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        staging: HostStaging | None = None,
    ) -> None:
        manifest = cp.WeightManifest(parameters=[spec for spec, _ in entries])
        self._manifest = cp.PushWeightsRequest(manifest=manifest).SerializeToString()
        self._chunk_bytes = chunk_bytes
        datas = [data for _, data in entries]
        hosts = staging.to_host(datas) if staging else [host_array(data) for data in datas]
        self._entries = [(spec.name, host) for (spec, _), host in zip(entries, hosts, strict=True)]
        self._crcs = [
            [
                crc32(memoryview(data[offset : offset + chunk_bytes]))
                for offset in range(0, max(len(data), 1), chunk_bytes)
            ]
            for _, data in self._entries
        ]
        # Bytes of parameter data this stream carries (what a server receives).
        self.total_bytes = sum(len(data) for _, data in self._entries)
        # Bytes of every message (what one send of the stream carries).
        self.wire_bytes = sum(len(head) + len(data) for head, data in self.frames())
        # No parameter at all (a group where nothing changed): not worth a stream.
        self.empty = not self._entries

    def __iter__(self) -> Iterator[bytes]:
        for head, data in self.frames():
            yield b"".join((head, data)) if len(data) else head

    def frames(self) -> Iterator[tuple[bytes, memoryview]]:
        """The same messages, each as its head and its data (a view of the tensor's memory,
        empty for the manifest): a socket writes the two without joining them."""
        yield self._manifest, memoryview(b"")
        size = self._chunk_bytes
        for (name, data), crcs in zip(self._entries, self._crcs, strict=True):
            for index, crc in enumerate(crcs):
                offset = index * size
                piece = memoryview(data[offset : offset + size])
                yield chunk_head(name, offset, len(piece), crc), piece


def push_groups(
    named_tensors: list[tuple[str, Any]], group_bytes: int
) -> list[list[tuple[str, Any]]]:
    """The tensors in order, in groups of about ``group_bytes`` (a bigger tensor alone)."""
    groups: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, tensor in named_tensors:
        tensor_bytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + tensor_bytes > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, tensor))
        size += tensor_bytes
    return groups


def push_messages(
    named_tensors: Iterable[tuple[str, Any]],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    with_checksums: bool = True,
) -> list[bytes]:
    """The serialized PushWeights stream of whole tensors as a list (for tests and benchmarks;
    the client sends a ``PushStream``)."""
    return list(PushStream(tensor_entries(named_tensors, with_checksums), chunk_bytes))


_PEFT_ADAPTER_SEGMENT = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")


def peft_tensor_name(name: str) -> str:
    """The name a server expects for a tensor of a PEFT adapter: a PEFT model's own
    ``state_dict()`` names carry the adapter's name (``...q_proj.lora_A.default.weight``),
    ``get_peft_model_state_dict`` and saved adapters do not (``...q_proj.lora_A.weight``)."""
    return _PEFT_ADAPTER_SEGMENT.sub(r".lora_\1.weight", name)


def lora_push_messages(
    named_tensors: Iterable[tuple[str, Any]], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[cp.LoadLoraAdapterRequest]:
    """An adapter's tensors as LoadLoraAdapter messages: the manifest (with SHA-256 per
    tensor), then checksummed chunks, exactly as PushWeights sends weights."""
    named = [(peft_tensor_name(name), tensor) for name, tensor in named_tensors]
    messages = []
    for raw in push_messages(named, chunk_bytes=chunk_bytes):
        push = cp.PushWeightsRequest.FromString(raw)
        if push.HasField("manifest"):
            messages.append(cp.LoadLoraAdapterRequest(manifest=push.manifest))
        else:
            messages.append(cp.LoadLoraAdapterRequest(chunk=push.chunk))
    return messages


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
        self._cancel_join = threading.Event()
        # The rendezvous store (rank 0 listens on master_port while it lives).
        self._store: Any = None
        # Two bucket buffers, kept across updates: one is packed while the other is broadcast,
        # and memory touched for the first time costs page faults that can take longer than
        # the broadcast itself.
        self._scratch: list[Any] = [None, None]

    @property
    def group(self) -> Any:
        """The joined process group (``None`` before ``join()``)."""
        return self._group

    def join(self) -> None:
        """Blocks until every server worker has joined (run it concurrently with their init);
        ``cancel_join`` from another thread ends it at once, for every rank."""
        if self._store is None:
            self._store = master_store(
                self.master_address, self.master_port, self.world_size, self.timeout_seconds
            )
        self._group = join_group(
            self.backend,
            self.master_address,
            self.master_port,
            0,
            self.world_size,
            self.group_name,
            self.timeout_seconds,
            cancel=self._cancel_join,
            store=self._store,
        )

    def cancel_join(self) -> None:
        """Gives the rendezvous up (a server refused to join): ``join`` and the servers'
        joins fail promptly (``release`` then frees the master port)."""
        self._cancel_join.set()

    def release(self) -> None:
        """Closes the rendezvous store of a join given up, freeing the master port: once the
        servers' joins have ended (they read the abort from it)."""
        self._store = None

    def broadcast(self, buckets: list[PackedBucket]) -> int:
        """Broadcasts each packed bucket in order; returns the bytes sent.

        Packing a bucket overlaps the broadcast of the one before it (two buffers in turn).
        """
        from datetime import timedelta

        import torch

        if self._group is None:
            raise RuntimeError("join() first")
        device = "cuda" if self.backend == "nccl" else "cpu"
        timeout = timedelta(seconds=self.timeout_seconds)
        largest = max((b.layout.size_bytes for b in buckets if not b.direct), default=0)
        in_flight: list[Any] = [None, None]
        sent = 0
        for index, bucket in enumerate(buckets):
            slot = index % 2
            if in_flight[slot] is not None:
                in_flight[slot].wait(timeout)  # its buffer may be about to be packed again
            if bucket.direct:
                buffer = bucket.pack().to(device)  # no copy when it is already there
            else:
                scratch = self._scratch[slot]
                if scratch is None or scratch.numel() < largest:
                    scratch = torch.empty(largest, dtype=torch.uint8, device=device)
                    self._scratch[slot] = scratch
                buffer = bucket.pack(into=scratch)
            in_flight[slot] = self._group.broadcast(buffer, 0)
            sent += buffer.numel()
        for work in in_flight:
            if work is not None:
                work.wait(timeout)
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
