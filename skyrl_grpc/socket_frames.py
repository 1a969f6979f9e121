"""Length-prefixed frames on a blocking TCP socket: the push socket's wire (see
``PushSocketHello`` in control_plane.proto). A frame is an 8-byte little-endian length, then
that many bytes.

Both ends move a frame in about one system call and never copy it in Python: the sender writes
a frame's parts (a small head, then a tensor's memory) with one scatter write, the receiver
reads a whole frame into memory allocated for it with ``MSG_WAITALL``. Both calls release the
GIL, so the bytes move while the sender's and the receiver's other threads work.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

FRAME_HEADER = struct.Struct("<Q")


class FrameTooLarge(ValueError):
    """A frame longer than the receiver takes."""


def send_frame(sock: socket.socket, *parts: Any) -> None:
    """Writes one frame whose bytes are ``parts`` (bytes, memoryviews or arrays) back to back."""
    views = [memoryview(part).cast("B") for part in parts]
    header = FRAME_HEADER.pack(sum(len(view) for view in views))
    pending = [memoryview(header), *(view for view in views if len(view))]
    while pending:
        sent = sock.sendmsg(pending)
        while sent:  # a partial write: drop what went, resume with the rest
            if sent >= len(pending[0]):
                sent -= len(pending[0])
                pending.pop(0)
            else:
                pending[0] = pending[0][sent:]
                sent = 0


def fresh_memory(size: int) -> memoryview:
    """``size`` bytes of memory of their own, uninitialised (the read overwrites them)."""
    return np.empty(size, dtype=np.uint8).data.cast("B")


def recv_frame(
    sock: socket.socket, limit: int, allocate: Callable[[int], memoryview] = fresh_memory
) -> memoryview | None:
    """The next frame's bytes, read into ``allocate(size)``, or None if the connection closed
    cleanly before it. Raises ``FrameTooLarge`` for a frame over ``limit`` bytes,
    ``ConnectionError`` for one cut short."""
    header = _recv_exactly(sock, memoryview(bytearray(FRAME_HEADER.size)), at_start=True)
    if header is None:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    if size > limit:
        raise FrameTooLarge(f"a {size}-byte frame, over the {limit} bytes this receiver takes")
    frame = allocate(size)
    _recv_exactly(sock, frame, at_start=False)
    return frame


def _recv_exactly(sock: socket.socket, into: memoryview, at_start: bool) -> memoryview | None:
    received = 0
    while received < len(into):
        count = sock.recv_into(into[received:], len(into) - received, socket.MSG_WAITALL)
        if count == 0:
            if at_start and received == 0:
                return None
            raise ConnectionError(f"the connection closed {received} bytes into a frame")
        received += count
    return into
