"""In-band bytes handed from the server to the worker through shared memory.

A PushWeights stream arrives in the server process; the weights live in vLLM's worker (the
engine core's process at TP=1, a process of its own per rank above). vLLM's utility calls would
carry the bytes inline: msgpack copies them into its message, ZMQ through a socket, msgpack again
into new ``bytes`` on the other side, and at TP > 1 vLLM's executor pickles them once more to
broadcast to every rank, though only rank 0 keeps them. Measured on the 0.3B benchmark model,
that path cost the engine core ~0.5 s of CPU per full bf16 update (0.55 GiB), more than
reloading the model. Instead the server copies each stage batch into one file in shared memory
(``/dev/shm``) and the call carries where each parameter's bytes lie in it; the worker maps the
file once and copies from it into its staging tensors: one copy on each side.

One buffer serves every batch: the server writes a batch only after the worker finished with
the previous one (the stage call returned, or, for a call the server stopped waiting for, the
engine core runs calls in order, so the worker finishes that one before it reads the next, and
an update abandoned so is discarded anyway). A batch that does not fit, or a server where the
file cannot be made, sends its bytes inline as before.

The file is removed once the worker has mapped it (its mapping and the server's stay valid), so
a server killed later leaves nothing in ``/dev/shm``; until the first update it removes it when
it closes.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections.abc import Sequence

log = logging.getLogger(__name__)

SHARED_MEMORY_DIR = "/dev/shm"


class HandoffBuffer:
    """The server's side: a fixed-size file in shared memory, mapped for writing."""

    def __init__(self, size: int, directory: str = SHARED_MEMORY_DIR) -> None:
        fd, self.path = tempfile.mkstemp(prefix="skyrl-weights-", dir=directory)
        try:
            # Reserved now: a tmpfs out of space fails here, not with SIGBUS at a write.
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.size = size
        self._linked = True

    @classmethod
    def create(cls, size: int, directory: str = SHARED_MEMORY_DIR) -> HandoffBuffer | None:
        """The buffer, or None (bytes go inline) where shared memory cannot be had."""
        try:
            return cls(size, directory)
        except OSError as error:
            log.warning("no shared memory for weight updates (%s): bytes go inline", error)
            return None

    def place(self, pieces: Sequence[Sequence[bytes | memoryview]]) -> list[list[int]] | None:
        """Copies each piece's chunks into the buffer, one after another; returns where each
        piece lies (``[start, length]``), or None when they do not fit (nothing written)."""
        if sum(len(chunk) for chunks in pieces for chunk in chunks) > self.size:
            return None
        regions = []
        offset = 0
        for chunks in pieces:
            start = offset
            for chunk in chunks:
                end = offset + len(chunk)
                self._map[offset:end] = chunk
                offset = end
            regions.append([start, offset - start])
        return regions

    def mapped(self) -> None:
        """The worker has the file mapped: the name is no longer needed."""
        self._unlink()

    def close(self) -> None:
        self._unlink()
        self._map.close()

    def _unlink(self) -> None:
        if self._linked:
            self._linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class HandoffReader:
    """The worker's side: the server's buffers, mapped read-only once each."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def view(self, path: str, region: Sequence[int]) -> memoryview:
        """The bytes at ``region`` (``[start, length]``) of the buffer at ``path``."""
        start, length = region
        return memoryview(self._map(path))[start : start + length]

    def _map(self, path: str) -> mmap.mmap:
        mapped = self._maps.get(path)
        if mapped is None:
            with open(path, "rb") as file:
                mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[path] = mapped
        return mapped
