"""Keep freed host memory mapped in the process, so large buffers are reused instead of refaulted.

A weight update allocates and frees about the model's size in host buffers every training step
(gRPC messages, staged tensors, packed buckets). glibc gives every block above its mmap threshold
(at most 32 MiB) its own mapping and unmaps it on free, and trims the heap top, so the next
update touches fresh pages again. Page faults then cost more than the transfer: on the 2-core VMs
this project is measured on, copying into fresh memory runs at ~1.1 GB/s and into reused memory
at ~9.5 GB/s (`scripts/bench_weights.py` shows what it does to the transfer itself).

``keep_freed_memory()`` turns both off: large blocks come from the heap and freed memory stays
there for the next update. The price: the process's resident memory stays at its peak. The engine
server calls it at start-up (``--return-freed-memory`` opts out); a trainer may call it too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

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
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        return False
    if children:
        os.environ.update(ENVIRONMENT)
    return True
