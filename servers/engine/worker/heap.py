"""Giving freed heap back to the system after weight updates, once it has piled up.

Every update frees what the last one allocated (staged tensors, vLLM's layerwise-reload
buffers, oneDNN's repacked weights), and the engine keeps freed memory for reuse instead of
returning it (``skyrl_grpc.host_memory``: reused pages fill ~9x faster than fresh ones).
Updates of mixed sizes (full, sparse, compressed; in-band and collective) reuse it poorly, so
a long RL run's server grew to ~3x the model's bytes above its start, all of it free heap
(``host_memory.freed_memory_trim`` gives it back). Trimming after every update would cost each
next update the page faults of touching fresh memory; trimming only once the process has grown
past its start by a slack bounds the growth and costs an occasional update.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

Trim = Callable[[], None]  # gives freed heap back (malloc_trim)


def resident_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


class HeapKeeper:
    """Trims the heap after an update once the process has grown by more than ``slack`` bytes
    past where it stood when the keeper was made (the worker makes it as its first update
    starts).

    Where a trim leaves it above that ceiling anyway (memory in use, not freed), the ceiling
    rises to half a slack above what is left, so a server does not trim after every update."""

    def __init__(
        self,
        slack: int,
        trim: Trim | None,
        resident: Callable[[], int] = resident_bytes,
    ) -> None:
        self._trim = trim  # None: a C library that cannot give heap back
        self._resident = resident
        self.slack = slack
        self.ceiling = resident() + slack
        self.trims = 0

    def check(self) -> bool:
        """After an update: trims if grown past the ceiling; whether it trimmed."""
        now = self._resident()
        if self._trim is None or now <= self.ceiling:
            return False
        self._trim()
        self.trims += 1
        after = self._resident()
        log.info("gave %.0f MiB of freed heap back to the system", (now - after) / 2**20)
        self.ceiling = max(self.ceiling, after + self.slack // 2)
        return True


def give_heap_back() -> int:
    """Gives the freed heap back to the system now (``malloc_trim``); the bytes it gave."""
    from skyrl_grpc.host_memory import freed_memory_trim

    trim = freed_memory_trim()
    if trim is None:
        return 0
    before = resident_bytes()
    trim()
    return max(before - resident_bytes(), 0)


def touch_heap(size: int) -> int:
    """Faults ``size`` bytes of heap in and frees them: kept by the allocator (the server keeps
    freed memory, ``host_memory``), the next allocations as large reuse them instead of
    faulting fresh pages in inside an update. Returns ``size``."""
    if size > 0:
        import torch

        torch.zeros(size, dtype=torch.uint8)
    return size
