"""What an in-band update is cut into before it is sent: shares of about equal bytes (one per
relay tree), each in groups (one manifest each; a stream carries a share's groups back to
back), each group in chunks (``chunk_bytes_for``); and the preparation of each group one ahead
of the one being sent (``OneAhead``), so the trainer's work overlaps the transfer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from trainer_client.weights.weight_sending import DEFAULT_CHUNK_BYTES, push_groups

# Source bytes of the tensors in one group (one manifest of a stream): big enough that a
# manifest costs nothing, small enough that preparing the next group overlaps sending this one.
PUSH_GROUP_BYTES = 64 << 20
T = TypeVar("T")


class Shares:
    """An update's tensors split into shares of about equal bytes, in order (one per relay
    tree), each in groups of ``PUSH_GROUP_BYTES`` (one stream's manifest each); computed once
    per count of shares."""

    def __init__(self, tensors: list[tuple[str, Any]]) -> None:
        self._tensors = tensors
        self._groups: dict[tuple[int, int], list[list[tuple[str, Any]]]] = {}

    def groups(self, index: int, count: int) -> list[list[tuple[str, Any]]]:
        """Share ``index`` of ``count``, in groups."""
        if (index, count) not in self._groups:
            for i, share in enumerate(split_shares(self._tensors, count)):
                self._groups[(i, count)] = push_groups(share, PUSH_GROUP_BYTES)
        return self._groups[(index, count)]

    def bytes(self, index: int, count: int) -> int:
        """The source bytes of share ``index`` of ``count``."""
        return sum(t.numel() * t.element_size() for g in self.groups(index, count) for _, t in g)


# Chunks down a relay tree across hosts: a share's 1/RELAY_CHUNKS_PER_SHARE, within these
# bounds.
RELAY_CHUNKS_PER_SHARE = 512
RELAY_CHUNK_BYTES = (256 << 10, DEFAULT_CHUNK_BYTES)


def chunk_bytes_for(asked: int | None, share_bytes: int, across: bool) -> int:
    """The chunk size of a stream: what the caller asked for, else 4 MiB to one host and, down
    a relay tree across hosts, 1/512 of the tree's share (every hop forwards a chunk once it
    holds it whole, so the pipeline fills and drains in a chunk's time per hop: 1/512 of the
    share's time each, where 4 MiB chunks of a 0.38 GB model's half cost 2% of the update
    per hop; measured on the testbed, docs/weights.md). Loopback hops are too fast for it to
    matter: a tree on one host keeps 4 MiB chunks, which cost its servers less CPU."""
    if asked is not None:
        return asked
    if not across:
        return DEFAULT_CHUNK_BYTES
    low, high = RELAY_CHUNK_BYTES
    return max(low, min(high, share_bytes // RELAY_CHUNKS_PER_SHARE >> 16 << 16))


def split_shares(tensors: list[tuple[str, Any]], count: int) -> list[list[tuple[str, Any]]]:
    """``tensors`` in ``count`` runs of about equal bytes, in order (a tensor is never split:
    a share may be empty when there are fewer tensors than shares)."""
    sizes = [tensor.numel() * tensor.element_size() for _, tensor in tensors]
    total = sum(sizes) or 1
    shares: list[list[tuple[str, Any]]] = [[] for _ in range(count)]
    before = 0
    for named, size in zip(tensors, sizes, strict=True):
        # The share holding the tensor's middle byte.
        shares[min(count - 1, (2 * before + size) * count // (2 * total))].append(named)
        before += size
    return shares


class OneAhead(Generic[T]):
    """Items ``make(index)`` prepared in a worker thread, each once, the next one started when
    one is asked for: the trainer's work on group k+1 (patches, checksums, buckets) overlaps
    the transfer of group k instead of preceding it."""

    def __init__(self, make: Callable[[int], T], count: int) -> None:
        self._make = make
        self._count = count
        self._started: dict[int, asyncio.Future[T]] = {}

    async def get(self, index: int) -> T:
        for k in (index, index + 1):
            if k < self._count and k not in self._started:
                self._started[k] = asyncio.ensure_future(asyncio.to_thread(self._make, k))
        return await self._started[index]

    def cancel(self) -> None:
        """Drops what was prepared (a failed or finished update); a preparation already running
        in its thread (at most one ahead) finishes there and is discarded."""
        for pending in self._started.values():
            pending.cancel()
