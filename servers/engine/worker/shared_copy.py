"""The checkpoint copy in memory every tensor-parallel rank of a server can read.

vLLM's weight loaders take whole checkpoint tensors and each rank cuts its shard out, so every
rank's reload reads every tensor of the layers it reloads. TP rank 0 keeps the one copy of a
server (``checkpoint.ServingCheckpoint``); where it lies in anonymous memory, rank 0 has to send
each tensor to the other ranks (``tp_share``), one at a time and in lockstep: at TP=2 on the
benchmark VM that made vLLM's reload 4x slower than at TP=1. Here the copy and its spare tensors
lie in one shared-memory file (a ``memfd``: not a name in ``/dev/shm``, so no size limit of a
container's ``/dev/shm`` applies and nothing is left behind when the server dies) that the other
ranks of the same host map and read where rank 0 says each tensor lies: the ranks reload in
parallel and nothing is sent.

Each parameter has two places (slots) in the file: the serving value and its spare (the new
value an update stages, then what a commit replaced, kept for a rollback). A slot's memory is
given back to the system (``release``) when the value it held is dropped, and taken again when
the next update writes it. Slots start on a page boundary, so releasing one frees whole pages.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from skyrl_grpc.dtypes import num_elements

PAGE = mmap.PAGESIZE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    """Where one value lies in the file."""

    offset: int
    nbytes: int


def _page_aligned(size: int) -> int:
    return -(-size // PAGE) * PAGE


class SharedCopy:
    """Rank 0's side: the file, mapped for writing, with two slots per parameter.

    ``layout``: each parameter's name, element type and shape, in the checkpoint's order."""

    def __init__(self, layout: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._slots: dict[str, tuple[Slot, Slot]] = {}
        self._at: dict[int, tuple[str, int]] = {}  # a slot's offset: its parameter and index
        offset = 0
        for name, dtype, shape in layout:
            nbytes = dtype.itemsize * num_elements(tuple(shape))
            size = _page_aligned(max(nbytes, 1))
            self._slots[name] = (Slot(offset, nbytes), Slot(offset + size, nbytes))
            self._layout[name] = (dtype, tuple(shape))
            self._at[offset], self._at[offset + size] = (name, 0), (name, 1)
            offset += 2 * size
        self.size = max(offset, PAGE)
        self._fd = os.memfd_create("skyrl-weights-checkpoint", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, self.size)
            self._map = mmap.mmap(self._fd, self.size)
        except BaseException:
            os.close(self._fd)
            raise
        self._base = torch.frombuffer(self._map, dtype=torch.uint8)
        self._reserved: set[tuple[str, int]] = set()

    @property
    def path(self) -> str:
        """Where another process of this host opens the file (this process's descriptor)."""
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    def value(self, name: str, which: int) -> torch.Tensor:
        """The tensor in slot ``which`` (0 or 1) of ``name``; its memory is reserved first, so a
        host out of memory fails here rather than at a write."""
        slot = self._slots[name][which]
        if (name, which) not in self._reserved:
            # Allocates the slot's pages (zeroed, if they were not there): where memory is
            # short, this raises OSError instead of a later write faulting.
            os.posix_fallocate(self._fd, slot.offset, _page_aligned(max(slot.nbytes, 1)))
            self._reserved.add((name, which))
        dtype, shape = self._layout[name]
        raw = self._base[slot.offset : slot.offset + slot.nbytes]
        return raw.view(dtype).view(shape)

    def other(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The slot of ``name`` that ``tensor`` does not occupy (None when ``tensor`` lies in
        neither: the copy was not made here)."""
        which = self.which(name, tensor)
        return None if which is None else self.value(name, 1 - which)

    def which(self, name: str, tensor: torch.Tensor) -> int | None:
        """Which slot of ``name`` holds ``tensor`` (None: neither)."""
        offset = self.offset_of(tensor)
        place = None if offset is None else self._at[offset]
        return place[1] if place is not None and place[0] == name else None

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Where ``tensor`` starts in the file, if it is a whole slot's value lying there."""
        if tensor.device.type != "cpu":
            return None
        start = tensor.data_ptr() - self._base.data_ptr()
        place = self._at.get(start)
        if place is None or not tensor.is_contiguous():
            return None
        if tensor.nbytes != self._slots[place[0]][place[1]].nbytes:
            return None
        return start

    def release(self, tensors: Iterable[torch.Tensor]) -> int:
        """Gives the pages of the slots these values occupy back to the system (their contents
        are lost: they read as zeros); returns the bytes released. Values not in the file are
        skipped (they are freed when dropped)."""
        released = 0
        for tensor in tensors:
            offset = self.offset_of(tensor)
            if offset is None:
                continue
            self._reserved.discard(self._at[offset])
            # The pages go from the file (shared memory's hole punch): every mapping then reads
            # zeros there, the other ranks' included.
            self._map.madvise(mmap.MADV_REMOVE, offset, _page_aligned(tensor.nbytes))
            released += tensor.nbytes
        return released

    def allocated_bytes(self) -> int:
        """The file's memory now (what ``release`` gives back, it no longer counts)."""
        return os.fstat(self._fd).st_blocks * 512


class SharedCopyReader:
    """Another rank's side: the file mapped as its own private view (a stray write would land in
    this process's memory, never in rank 0's copy), read where rank 0 says a tensor lies."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}

    def why_unreadable(self, path: str) -> str:
        """Maps ``path``; says why this rank cannot ("" when it can): a rank on another host,
        or one not allowed to open rank 0's descriptor, gets the tensors sent instead."""
        try:
            self._base(path)
        except (OSError, ValueError) as error:
            return f"{type(error).__name__}: {error}"
        return ""

    def tensor(self, path: str, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        nbytes = dtype.itemsize * num_elements(shape)
        base = self._base(path)
        return base[offset : offset + nbytes].view(dtype).view(shape)

    def _base(self, path: str) -> torch.Tensor:
        mapped = self._maps.get(path)
        if mapped is None:
            with open(path, "rb") as file:
                view = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
            mapped = self._maps[path] = (view, torch.frombuffer(view, dtype=torch.uint8))
        return mapped[1]


def layout_of(tensors: dict[str, Any]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The layout of named tensors (or of anything with ``dtype`` and ``shape``)."""
    return [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def copied(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], SharedCopy | None]:
    """Copies of ``tensors`` in the first places of a new shared copy, and the copy; plain
    copies in this process's memory (and None) where no shared memory can be made."""
    try:
        shared = SharedCopy(layout_of(tensors))
    except OSError as error:
        log.warning("no shared memory for the checkpoint copy (%s): ranks get it sent", error)
        return {name: tensor.clone() for name, tensor in tensors.items()}, None
    return {name: shared.value(name, 0).copy_(t) for name, t in tensors.items()}, shared
