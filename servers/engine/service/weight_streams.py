"""The streams of a weight update into this server, whichever way they come: PushWeights calls
and push socket streams, from the trainer or relayed by this server's parent in the update's
relay plan. Each is checked against the open update first (its ticket, its sender: a forged
relay stages nothing), forwarded down the relay plan when it comes from the parent
(``peers.relay``), and staged (``peer_streams.stage_stream``); what it came to is answered for
the whole subtree: a push socket reply, or a PushWeights status with its trailing metadata.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from servers.common.grpc_types import Context
from servers.common.interceptors import status_of
from servers.engine.domain.weights.relay_role import forwarded_tree
from servers.engine.domain.weights.transaction import WeightTransferManager
from servers.engine.peers.peer_streams import Failure, Item, StreamOutcome, stage_stream
from servers.engine.peers.relay import Relays, failures_to_proto
from skyrl_grpc.errors import error_with
from skyrl_grpc.metadata import RELAY_FAILURES
from skyrl_grpc.v1 import control_plane_pb2 as cp

# One stream's messages: each its bytes as received (what is forwarded) and its item.
Messages = AsyncIterator[tuple[bytes | memoryview | None, Item]]


class WeightStreams:
    """Takes streams into the open update of ``updates()`` (UNAVAILABLE before the engine
    serves), relaying through ``relays``."""

    def __init__(self, updates: Callable[[], WeightTransferManager], relays: Relays) -> None:
        self._updates = updates
        self._relays = relays

    def check_sender(self, ticket: bytes | None, relayed_from: str, tree: int | None) -> None:
        """Raises unless a stream presenting ``ticket`` (None: a gRPC call, authorised by its
        channel) from ``relayed_from`` ("": the trainer) down relay tree ``tree`` (None: none
        named) may stream into the open update."""
        self._updates().check_sender(ticket, relayed_from, tree)

    async def stage(
        self, ticket: bytes | None, relayed_from: str, tree: int | None, messages: Messages
    ) -> tuple[StreamOutcome, str]:
        """Checks, forwards and stages one stream; what it came to, and how the relay plan
        names this server ("" without one)."""
        updates = self._updates()
        update = updates.check_sender(ticket, relayed_from, tree)
        role = update.relay
        below = forwarded_tree(role, relayed_from, tree)
        forwarding = self._relays.stream(update, below) if below is not None else None
        outcome = await stage_stream(
            messages, lambda items: updates.push(items, ticket), forwarding
        )
        return outcome, role.address if role is not None else ""


def subtree_failures(outcome: StreamOutcome, address: str) -> list[Failure]:
    """Every server of the subtree that did not stage the stream, this one first."""
    failures = list(outcome.below)
    if outcome.error is not None:
        code, message = status_of(outcome.error, "a weight stream")
        failures.insert(0, Failure(address, code, message))
    return failures


def socket_reply(outcome: StreamOutcome, address: str) -> cp.PushSocketReply:
    """The push socket's answer to a stream: its own status and its subtree's failures."""
    if outcome.error is None and not outcome.below:
        response = cp.PushWeightsResponse(
            parameters_staged=outcome.staged, bytes_received=outcome.received
        )
        return cp.PushSocketReply(response=response)
    failures = subtree_failures(outcome, address)
    first = failures[0]
    return cp.PushSocketReply(
        code=first.code.value[0],
        message=first.message,
        relay_failures=failures_to_proto(failures) if outcome.below else [],
    )


def push_response(outcome: StreamOutcome, address: str, context: Context) -> cp.PushWeightsResponse:
    """A PushWeights call's answer: its response, or (raised) the status of the subtree's first
    failure, the subtree's failures in the trailing metadata when a server below failed."""
    if outcome.below:
        failures = subtree_failures(outcome, address)
        below = cp.RelayFailures(failures=failures_to_proto(failures))
        context.set_trailing_metadata(((RELAY_FAILURES, below.SerializeToString()),))
        first = failures[0]
        raise error_with(first.code, first.message)
    if outcome.error is not None:
        raise outcome.error
    return cp.PushWeightsResponse(parameters_staged=outcome.staged, bytes_received=outcome.received)
