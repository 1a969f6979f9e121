"""Memory for the push socket's frames, reused across frames, connections and updates.

A frame's data is read into memory, checked, and handed to the workers a batch later; then
nothing refers to it. Allocating that memory afresh per frame, in the threads that read the
frames, grew the server by ~40 MiB an update at 0.3B parameters (glibc's per-thread arenas keep
what each thread freed, and each connection's thread could get another arena); reusing a
buffer once its last view is gone allocates the few buffers a stream keeps in flight once.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from skyrl_grpc.socket_frames import fresh_memory

# Frames smaller than this get memory of their own (a manifest, a reply): not worth keeping.
POOLED_BYTES = 1 << 20
# Buffers are made this much larger than the frame asking for one (a chunk's head varies by a
# few bytes with its name), so the next chunk of the same size fits.
SLACK_BYTES = 64 << 10
# What a free buffer's reference count is while ``take`` looks at it: the pool's list, the
# loop's variable, and ``sys.getrefcount``'s own argument. A frame handed out holds one more
# (its memoryview, and every view sliced from it, holds the buffer through one managed buffer).
_FREE_REFERENCES = 3


class FrameBuffers:
    """Buffers for received frames: ``take(size)`` returns a view of a buffer no view refers
    to any more, or of a new one. Safe to call from several threads."""

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        if size < POOLED_BYTES:
            return fresh_memory(size)
        with self._lock:
            for buffer in self._buffers:
                if len(buffer) >= size and sys.getrefcount(buffer) == _FREE_REFERENCES:
                    return buffer.data[:size]
            buffer = np.empty(size + SLACK_BYTES, dtype=np.uint8)
            self._buffers.append(buffer)
            return buffer.data[:size]

    @property
    def held_bytes(self) -> int:
        """The memory the pool holds (in use or free)."""
        return sum(len(buffer) for buffer in self._buffers)
