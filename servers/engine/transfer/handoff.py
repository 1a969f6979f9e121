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

A worker that cannot map the file (on another host, or in a container with a ``/dev/shm`` of its
own) says so in its report instead of staging; the server then sends that batch and every later
one inline.

One buffer serves every batch: the server writes a batch only after the worker finished with
the previous one (the stage call returned, or, for a call the server stopped waiting for, the
engine core runs calls in order, so the worker finishes that one before it reads the next, and
an update abandoned so is discarded anyway). It holds a batch and the chunk that overshoots it
(``buffer_bytes_for``); what does not fit (a large patch completing a batch) goes in the next
call, through the buffer again. Only a piece larger than the whole buffer, or every piece on a
server where the file cannot be made, goes inline as before.

The file is made at the first in-band update and removed as soon as the worker has mapped it
(its mapping and the server's stay valid), so a server killed later leaves nothing in
``/dev/shm``; one killed in between leaves a file that the next server to make one removes.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections.abc import Sequence

log = logging.getLogger(__name__)

SHARED_MEMORY_DIR = "/dev/shm"
# Buffers are named PREFIX + the server's process id + "-" + a random part.
PREFIX = "skyrl-weights-"
# What a stage batch overshoots its size by: the chunk that completes it (the trainer client
# sends 4 MiB chunks by default).
OVERSHOOT_BYTES = 4 << 20


def buffer_bytes_for(stage_batch_bytes: int) -> int:
    """The buffer for stage batches of ``stage_batch_bytes``: one batch and its overshoot."""
    return stage_batch_bytes + OVERSHOOT_BYTES


class HandoffBuffer:
    """The server's side: a fixed-size file in shared memory, mapped for writing, made at the
    first in-band update (a server that never gets one holds none)."""

    def __init__(self, size: int, directory: str = SHARED_MEMORY_DIR) -> None:
        self.size = size
        self.directory = directory
        self.path = ""
        self._map: mmap.mmap | None = None
        self._linked = False
        self._unavailable = False

    @property
    def inline(self) -> bool:
        """Whether every batch goes inline now (no shared memory, or workers that cannot map it)."""
        return self._unavailable

    def place(self, pieces: Sequence[Sequence[bytes | memoryview]]) -> list[list[int]] | None:
        """Copies the pieces' chunks into the buffer, one piece after another while they fit;
        returns where each placed piece lies (``[start, length]``: the pieces that did not fit
        are the ones past the list's end), or None when the buffer cannot be had."""
        buffer = self._buffer()
        if buffer is None:
            return None
        regions: list[list[int]] = []
        offset = 0
        for chunks in pieces:
            length = sum(len(chunk) for chunk in chunks)
            if offset + length > self.size:
                break
            for chunk in chunks:
                end = offset + len(chunk)
                buffer[offset:end] = chunk
                offset = end
            regions.append([offset - length, length])
        return regions

    def read(self, region: Sequence[int]) -> bytes:
        """A copy of the bytes ``place`` put at ``region`` (``[start, length]``)."""
        assert self._map is not None, "nothing was placed"
        start, length = region
        return self._map[start : start + length]

    def mapped(self) -> None:
        """The worker has the file mapped: the name is no longer needed."""
        self._unlink()

    def give_up(self, why: str) -> None:
        """The workers cannot map the file: it is removed and every later batch goes inline."""
        log.warning("the workers cannot read shared memory (%s): weight bytes go inline", why)
        self._unavailable = True
        self.close()

    def close(self) -> None:
        self._unlink()
        if self._map is not None:
            self._map.close()
            self._map = None

    def _buffer(self) -> mmap.mmap | None:
        if self._map is None and not self._unavailable:
            try:
                self._map = self._make()
            except OSError as error:
                self._unavailable = True
                log.warning("no shared memory for weight updates (%s): bytes go inline", error)
        return self._map

    def _make(self) -> mmap.mmap:
        _remove_abandoned(self.directory)
        fd, self.path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.directory)
        self._linked = True
        try:
            # Reserved now: a tmpfs out of space fails here, not with SIGBUS at a write.
            os.posix_fallocate(fd, 0, self.size)
            return mmap.mmap(fd, self.size)
        except BaseException:
            self._unlink()
            raise
        finally:
            os.close(fd)

    def _unlink(self) -> None:
        if self._linked:
            self._linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _remove_abandoned(directory: str) -> None:
    """Removes buffers whose server died before its worker mapped them (killed mid-way through
    its first update): their names carry the server's process id."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class HandoffReader:
    """The worker's side: the server's buffers, mapped read-only once each."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def why_unreadable(self, path: str) -> str:
        """Maps the buffer at ``path``; returns why this worker cannot ("" when it can). A
        worker on another host, or in a container with a /dev/shm of its own, does not see
        the server's file: the server then sends the bytes inline."""
        try:
            self._map(path)
        except (OSError, ValueError) as error:
            return f"{type(error).__name__}: {error}"
        return ""

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
