"""The trainer's end of a server's push socket: PushWeights' streams without gRPC.

StartWeightUpdate tells the trainer, per server, the socket's port and the update's ticket
(``PushSocketOffer``). ``open_push_socket`` connects and presents the ticket; ``PushSocket.send``
then writes a ``PushStream``'s messages as frames straight from the tensors' memory (a
scatter write per chunk, no serialized copy) and returns what PushWeights would have
returned, or raises what it would have raised. The wire is ``PushSocketHello`` in
control_plane.proto; ``skyrl_grpc.socket_frames`` frames it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from skyrl_grpc.socket_frames import recv_frame, send_frame
from skyrl_grpc.v1 import control_plane_pb2 as cp
from trainer_client.exceptions import ServerError
from trainer_client.weights.weight_sending import PushStream

log = logging.getLogger(__name__)

# Seconds to connect: the socket is on the host the gRPC call just reached.
CONNECT_SECONDS = 10.0
# A reply is a status and its message: anything longer is not one.
REPLY_LIMIT = 1 << 20
_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}


@dataclass(frozen=True)
class PushSocketOffer:
    """A server's push socket for the open update: where it listens, what to present."""

    port: int
    ticket: bytes


class PushSocket:
    """One connection to one server's push socket, for one update. Blocking: the client runs
    its calls in a thread (the writes and reads release the GIL)."""

    def __init__(self, address: str, sock: socket.socket) -> None:
        self.address = address
        self._sock = sock

    def send(self, stream: PushStream) -> cp.PushWeightsResponse:
        """Sends one stream (as one PushWeights call would) and waits for the server's answer."""
        for head, data in stream.frames():
            send_frame(self._sock, head, data)
        send_frame(self._sock)  # the stream's end
        return self._reply().response

    def _reply(self) -> cp.PushSocketReply:
        raw = recv_frame(self._sock, REPLY_LIMIT)
        if raw is None:
            raise ServerError.of(
                self.address,
                grpc.StatusCode.UNAVAILABLE,
                "the push socket closed before answering",
            )
        reply = cp.PushSocketReply.FromString(bytes(raw))
        if reply.code:
            status = _STATUS_BY_CODE.get(reply.code, grpc.StatusCode.UNKNOWN)
            raise ServerError.of(self.address, status, reply.message)
        return reply

    def close(self) -> None:
        """Closes the connection; a send blocked in another thread fails at once."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    @classmethod
    def connect(cls, address: str, host: str, offer: PushSocketOffer, timeout: float) -> PushSocket:
        """Connects and presents the ticket; raises ``ServerError`` if the server refuses it,
        ``OSError`` if the socket cannot be reached or does not answer the hello in
        ``CONNECT_SECONDS``, ``ValueError`` if what answers is not a push socket."""
        sock = socket.create_connection((host, offer.port), timeout=CONNECT_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = cls(address, sock)
        try:
            send_frame(sock, cp.PushSocketHello(ticket=offer.ticket).SerializeToString())
            connection._reply()
        except BaseException:
            connection.close()
            raise
        sock.settimeout(timeout)
        return connection


async def open_push_socket(
    address: str, offer: PushSocketOffer | None, timeout: float
) -> PushSocket | None:
    """A connection to ``address``'s push socket, or None where there is none to use: not
    offered, an address that is not host:port, or a socket that cannot be reached or does
    not answer as one (a firewall letting only the gRPC port through, a gRPC proxy in front
    of the server: the update then goes over gRPC, said once per update in the log)."""
    host = host_of(address)
    if offer is None or host is None:
        return None
    try:
        return await asyncio.to_thread(PushSocket.connect, address, host, offer, timeout)
    except (OSError, ValueError, DecodeError) as error:  # FrameTooLarge is a ValueError
        log.warning(
            "%s: its push socket (port %d) cannot be reached (%s): pushing over gRPC",
            address,
            offer.port,
            error,
        )
        return None


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
