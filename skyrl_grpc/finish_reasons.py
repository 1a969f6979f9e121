"""Finish reasons: the one table between the contract's ``FinishReason`` and the names every
other side uses for it.

vLLM's outputs, OpenAI's and vLLM's HTTP answers and SkyRL all say ``"stop"``, ``"length"``
and ``"abort"``; the engine server converts vLLM's names to the enum with this table, and the
router's HTTP edge, the trainer client and the SkyRL drop-in convert the enum back with it.
"""

from __future__ import annotations

from skyrl_grpc.v1 import generation_pb2

STOP = "stop"
LENGTH = "length"
ABORT = "abort"

BY_NAME: dict[str, generation_pb2.FinishReason] = {
    STOP: generation_pb2.FINISH_REASON_STOP,
    LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    ABORT: generation_pb2.FINISH_REASON_ABORTED,
}
BY_PROTO: dict[int, str] = {proto: name for name, proto in BY_NAME.items()}


def to_proto(name: str | None) -> generation_pb2.FinishReason:
    """The contract's reason for an engine's; None (still running) is UNSPECIFIED, and a name
    this table does not know (a newer engine's) counts as a plain stop."""
    if name is None:
        return generation_pb2.FINISH_REASON_UNSPECIFIED
    return BY_NAME.get(name, generation_pb2.FINISH_REASON_STOP)


def name_of(reason: int) -> str | None:
    """The name of the contract's reason; None while a sample is unfinished."""
    return BY_PROTO.get(reason)
