"""Keep freed host memory mapped in the process, so large buffers are reused instead of refaulted.

A weight update allocates and frees about the model's size in host buffers every training step
(gRPC messages, staged tensors, packed buckets). glibc gives every block above its mmap threshold
(at most 32 MiB) its own mapping and unmaps it on free, and trims the heap top, so the next
update touches fresh pages again. Page faults then cost more than the transfer: on the 2-core VMs
this project is measured on, copying into fresh memory runs at ~1.1 GB/s and into reused memory
at ~9.5 GB/s (`scripts/bench_weight_sync.py` measures updates with it).

``keep_freed_memory()`` turns both off: large blocks come from the heap and freed memory stays
there for the next update. The price: the process's resident memory stays at its peak. The engine
server calls it at start-up (``--return-freed-memory`` opts out); a trainer may call it too.
``freed_memory_trim()`` is the bound on that price: it gives the freed heap back at once, which
the engine's weight workers do when it piles up (``servers/engine/worker/heap.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable
from typing import Any

# mallopt parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# The largest value mallopt takes (a C int): trimming only past 2 GiB of free heap top.
TRIM_THRESHOLD_BYTES = 2**31 - 1

#: What glibc reads at start-up in processes started later (vLLM's engine core, workers).
ENVIRONMENT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES)}


def keep_freed_memory(children: bool = True) -> bool:
    """Applies the policy to this process and, with ``children``, to processes it starts later.

    Returns False, changing nothing, where the C library is not glibc (musl, macOS: their
    allocators have no such knobs) or where glibc's ``MALLOC_*`` variables are already set: an
    operator's explicit choice stands.
    """
    if any(name in os.environ for name in ENVIRONMENT):
        return False
    mallopt = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        return False
    if children:
        os.environ.update(ENVIRONMENT)
    return True


def freed_memory_trim() -> Callable[[], None] | None:
    """``malloc_trim(0)``: gives every freed heap page back to the system. None where the C
    library is not glibc (nothing to trim)."""
    trim = _glibc("malloc_trim", [ctypes.c_size_t])
    if trim is None:
        return None

    def give_back() -> None:
        trim(0)

    return give_back


def _glibc(name: str, argtypes: list[Any]) -> Any:
    """The C library's function ``name`` (returning a C int), or None where it has none."""
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function
