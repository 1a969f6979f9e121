"""The trainer's end of a server's push socket: PushWeights' streams without gRPC.

StartWeightUpdate tells the trainer, per server, the socket's port and the update's ticket
(``PushSocketOffer``). ``open_push_socket`` connects and presents the ticket; ``PushSocket.send``
then writes a ``PushStream``'s messages as frames straight from the tensors' memory (a
scatter write per chunk, no serialized copy) and returns what PushWeights would have
returned, or raises what it would have raised (for a relayed stream, the first server of the
subtree that failed, ``RelayFailed`` naming every one). The connection itself is
``skyrl_grpc.push_socket_client``'s, which a relaying server uses too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from skyrl_grpc.errors import status_of
from skyrl_grpc.metadata import RELAY_FAILURES
from skyrl_grpc.push_socket_client import PushSocketConnection, host_of
from skyrl_grpc.v1 import control_plane_pb2 as cp
from trainer_client.exceptions import ServerError
from trainer_client.weights.weight_sending import PushStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushSocketOffer:
    """A server's push socket for the open update: where it listens, what to present."""

    port: int
    ticket: bytes


class RelayFailed(ServerError):
    """A relayed stream was not staged everywhere it reached: ``failures`` maps each server
    that failed (as the relay plan names it: the first server, or any below it) to its
    error."""

    def __init__(self, address: str, failures: dict[str, ServerError]) -> None:
        first = next(iter(failures.values()))
        super().__init__(address, first.code, f"relayed stream: {first}")
        self.failures = failures


def relay_failures(error: ServerError) -> dict[str, ServerError]:
    """Each server that failed a stream, by address: a relayed stream's subtree (over the push
    socket, ``RelayFailed``; over gRPC, the call's trailing metadata), else ``error``'s own."""
    if isinstance(error, RelayFailed):
        return dict(error.failures)
    cause = error.__cause__
    if isinstance(cause, grpc.aio.AioRpcError):
        for key, value in cause.trailing_metadata() or ():
            if key == RELAY_FAILURES and isinstance(value, bytes):
                failures = cp.RelayFailures.FromString(value).failures
                return {f.address: status_error(f.address, f.code, f.message) for f in failures}
    return {error.address: error}


def status_error(address: str, code: int, message: str) -> ServerError:
    """The error a status (as a reply carries it) stands for."""
    return ServerError.of(address, status_of(code), message)


def reply_error(address: str, reply: cp.PushSocketReply) -> ServerError | None:
    """What a stream's reply says went wrong (None: nothing), a relayed subtree's failures
    each named."""
    if reply.relay_failures:
        return RelayFailed(
            address,
            {f.address: status_error(f.address, f.code, f.message) for f in reply.relay_failures},
        )
    if reply.code:
        return status_error(address, reply.code, reply.message)
    return None


class PushSocket:
    """One connection to one server's push socket, for one update. Blocking: the client runs
    its calls in a thread (the writes and reads release the GIL)."""

    def __init__(self, address: str, connection: PushSocketConnection) -> None:
        self.address = address
        self._connection = connection

    def send(self, stream: PushStream) -> cp.PushWeightsResponse:
        """Sends one stream (as one PushWeights call would) and waits for the server's answer."""
        answer = self.send_chain([stream])
        assert answer is not None
        return answer

    def send_chain(self, streams: Iterable[PushStream]) -> cp.PushWeightsResponse | None:
        """Sends ``streams`` back to back as one stream of several manifests (a server that
        takes them: ``Capabilities.weight_relay_trees``) and waits for the server's answer;
        None when ``streams`` held nothing to send."""
        sent = False
        try:
            for stream in streams:
                for head, data in stream.frames():
                    self._connection.send(head, data)
                sent = True
            if not sent:
                return None
            reply = self._connection.end_stream()
        except ConnectionError as closed:
            raise ServerError.of(
                self.address, grpc.StatusCode.UNAVAILABLE, f"the push socket closed: {closed}"
            ) from closed
        refused = reply_error(self.address, reply)
        if refused is not None:
            raise refused
        return reply.response

    def close(self) -> None:
        """Closes the connection; a send blocked in another thread fails at once."""
        self._connection.close()

    @classmethod
    def connect(
        cls,
        address: str,
        host: str,
        offer: PushSocketOffer,
        timeout: float,
        relay_tree: int | None = None,
    ) -> PushSocket:
        """Connects and presents the ticket (and the relay tree its streams go down); raises
        ``ServerError`` if the server refuses it, ``OSError`` if the socket cannot be reached or
        does not answer the hello in time, ``ValueError`` if what answers is not a push
        socket."""
        connection, reply = PushSocketConnection.connect(
            host, offer.port, offer.ticket, timeout, relay_tree=relay_tree
        )
        error = reply_error(address, reply)
        if error is not None:
            connection.close()
            raise error
        return cls(address, connection)


async def open_push_socket(
    address: str, offer: PushSocketOffer | None, timeout: float, relay_tree: int | None = None
) -> PushSocket | None:
    """A connection to ``address``'s push socket, or None where there is none to use: not
    offered, an address that is not host:port, or a socket that cannot be reached or does
    not answer as one (a firewall letting only the gRPC port through, a gRPC proxy in front
    of the server: the update then goes over gRPC, said once per update in the log)."""
    host = host_of(address)
    if offer is None or host is None:
        return None
    try:
        return await asyncio.to_thread(
            PushSocket.connect, address, host, offer, timeout, relay_tree
        )
    except (OSError, ValueError, DecodeError) as error:  # FrameTooLarge is a ValueError
        log.warning(
            "%s: its push socket (port %d) cannot be reached (%s): pushing over gRPC",
            address,
            offer.port,
            error,
        )
        return None
