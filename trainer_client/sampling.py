"""Building the contract's request parts from what a trainer has at hand: sampling settings as
a mapping (or a message), chat messages as dicts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from skyrl_grpc.v1 import data_plane_pb2, generation_pb2

# Sampling settings: the message itself, a mapping of its field names, or None (defaults).
Sampling = generation_pb2.SamplingParams | Mapping[str, Any] | None
# A chat message: {"role": ..., "content": ...} or the message itself.
Message = Mapping[str, str] | data_plane_pb2.ChatMessage


def sampling_params(sampling: Sampling = None, **overrides: Any) -> generation_pb2.SamplingParams:
    """Builds SamplingParams from a message, a mapping of its field names, and overrides."""
    params = generation_pb2.SamplingParams()
    if isinstance(sampling, generation_pb2.SamplingParams):
        params.CopyFrom(sampling)
    elif sampling is not None:
        overrides = {**sampling, **overrides}
    for name, value in overrides.items():
        if value is None:
            continue
        if name in ("stop_token_ids", "stop_strings"):
            getattr(params, name)[:] = list(value)
        else:
            setattr(params, name, value)
    return params


def chat_messages(messages: Sequence[Message]) -> list[data_plane_pb2.ChatMessage]:
    return [
        m if isinstance(m, data_plane_pb2.ChatMessage) else data_plane_pb2.ChatMessage(**m)
        for m in messages
    ]
