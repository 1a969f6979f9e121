"""Building the contract's request parts from what a trainer has at hand: sampling settings as
a mapping (or a message), chat messages as dicts."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from skyrl_grpc.v1 import data_plane_pb2, generation_pb2
from trainer_client.tool_use import chat_message

# Sampling settings: the message itself, a mapping of its field names, or None (defaults).
Sampling = generation_pb2.SamplingParams | Mapping[str, Any] | None
# A chat message: {"role": ..., "content": ...} (OpenAI's shape, tool calls included) or the
# message itself.
Message = Mapping[str, Any] | data_plane_pb2.ChatMessage


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
        if name in ("stop_token_ids", "stop_strings", "allowed_token_ids"):
            getattr(params, name)[:] = list(value)
        elif name == "logit_bias":
            params.logit_bias.clear()
            params.logit_bias.update({int(k): float(v) for k, v in dict(value).items()})
        elif name == "structured_output":
            params.structured_output.CopyFrom(structured_output(value))
        else:
            setattr(params, name, value)
    return params


def structured_output(
    constraint: generation_pb2.StructuredOutput | Mapping[str, Any],
) -> generation_pb2.StructuredOutput:
    """A constraint from the message or one of ``{"json_schema": schema (a dict or JSON
    text)}``, ``{"json_object": True}``, ``{"regex": ...}``, ``{"choice": [...]}``,
    ``{"grammar": ...}``, ``{"structural_tag": tag (a dict or JSON text)}``."""
    if isinstance(constraint, generation_pb2.StructuredOutput):
        return constraint
    if len(constraint) != 1:
        raise ValueError(f"structured_output takes exactly one constraint, got {list(constraint)}")
    ((kind, value),) = constraint.items()
    if kind == "json_schema":
        text = value if isinstance(value, str) else json.dumps(value)
        return generation_pb2.StructuredOutput(json_schema=text)
    if kind == "choice":
        return generation_pb2.StructuredOutput(
            choice=generation_pb2.ChoiceList(choices=list(value))
        )
    if kind == "structural_tag":
        text = value if isinstance(value, str) else json.dumps(value)
        return generation_pb2.StructuredOutput(structural_tag=text)
    if kind in ("json_object", "regex", "grammar"):
        return generation_pb2.StructuredOutput(**{kind: value})
    raise ValueError(
        f"structured_output {kind!r}: use json_schema, json_object, regex, choice, grammar "
        "or structural_tag"
    )


def chat_messages(messages: Sequence[Message]) -> list[data_plane_pb2.ChatMessage]:
    return [chat_message(m) for m in messages]
