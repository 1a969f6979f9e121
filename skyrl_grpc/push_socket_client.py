"""The sending end of a server's push socket, for whoever streams into it: the trainer, and a
server relaying an update to the next (``PushSocketHello`` in control_plane.proto).

``PushSocketConnection.connect`` connects and presents the update's ticket (and, relayed, who
forwards); ``send`` writes one frame from its parts (a scatter write: no serialized copy),
``end_stream`` ends a stream and returns the server's ``PushSocketReply`` for it. Blocking:
callers run it in a thread of their own (the writes and reads release the GIL). What a reply's
status means to the caller is the caller's to say.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from skyrl_grpc.socket_frames import recv_frame, send_frame
from skyrl_grpc.v1 import control_plane_pb2 as cp

# Seconds to connect and be answered: the socket is on a host the gRPC port just answered on.
CONNECT_SECONDS = 10.0
# A reply is a status, its message and a subtree's failures: anything longer is not one.
REPLY_LIMIT = 16 << 20


class PushSocketConnection:
    """One connection to one server's push socket, for one update."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        ticket: bytes,
        timeout: float,
        relayed_from: str = "",
        relay_tree: int | None = None,
    ) -> tuple[PushSocketConnection, cp.PushSocketReply]:
        """Connects and presents ``ticket`` (and, relayed, who forwards and down which relay
        tree); returns the connection and the server's answer to the hello (code 0:
        accepted). Raises ``OSError`` if the socket cannot be reached or does not answer in
        ``CONNECT_SECONDS``, ``ValueError`` if what answers is not a push socket.
        ``timeout``: seconds any later send or reply may take."""
        sock = socket.create_connection((host, port), timeout=CONNECT_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = cls(sock)
        try:
            hello = cp.PushSocketHello(
                ticket=ticket, relayed_from=relayed_from, relay_tree=relay_tree
            )
            send_frame(sock, hello.SerializeToString())
            reply = connection.read_reply()
        except BaseException:
            connection.close()
            raise
        sock.settimeout(timeout)
        return connection, reply

    def send(self, *parts: Any) -> None:
        """Writes one frame whose bytes are ``parts`` back to back."""
        send_frame(self._sock, *parts)

    def end_stream(self) -> cp.PushSocketReply:
        """Ends the stream (an empty frame) and waits for the server's answer to it."""
        send_frame(self._sock)
        return self.read_reply()

    def read_reply(self) -> cp.PushSocketReply:
        raw = recv_frame(self._sock, REPLY_LIMIT)
        if raw is None:
            raise ConnectionError("the push socket closed before answering")
        return cp.PushSocketReply.FromString(bytes(raw))

    def close(self) -> None:
        """Closes the connection; a send blocked in another thread fails at once."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def host_of(address: str) -> str | None:
    """The host of a ``host:port`` address (``[v6]:port`` too); None for other targets (a
    unix socket, a name resolver's scheme)."""
    if "://" in address or address.startswith("unix:"):
        return None
    host, separator, port = address.rpartition(":")
    if not separator or not port.isdigit() or not host:
        return None
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return None if ":" in host else host
