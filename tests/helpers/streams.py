"""Building generation requests and reading what their streams sent, for the tests that speak
the DataPlane contract directly."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from skyrl_grpc.v1 import data_plane_pb2
from skyrl_grpc.v1 import generation_pb2 as gen

GREEDY = gen.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def stream_request(
    prompt: list[int], sampling: gen.SamplingParams = GREEDY, **fields: Any
) -> data_plane_pb2.GenerateStreamRequest:
    """A GenerateStreamRequest of ``prompt`` (``fields``: any other of its fields)."""
    return data_plane_pb2.GenerateStreamRequest(
        prompt_token_ids=prompt, sampling_params=sampling, **fields
    )


def tokens_of(chunks: Iterable[data_plane_pb2.GenerateStreamResponse]) -> list[int]:
    """Every token id the chunks carry, in order."""
    return [t for c in chunks for t in c.token_ids]


def unused_address() -> str:
    """A loopback address nothing listens on (its port was free a moment ago)."""
    from skyrl_grpc.process_group import free_port

    return f"127.0.0.1:{free_port('127.0.0.1')}"
