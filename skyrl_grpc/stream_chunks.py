"""Stream chunks merged: fewer messages carrying the same tokens.

A sample's consecutive chunks (``GenerateStreamResponse``) can travel as one: the server's
``stream_interval`` holds them back until enough tokens piled up, and a reader that fell behind
(at the server, or at a router relaying them) gets what waited as one message instead of many.
One rule for all of them, here: never across a weight-version change (each message names the
one version that produced its tokens) nor past a sample's end, and text as a delta.
"""

from __future__ import annotations

from skyrl_grpc import routed_experts
from skyrl_grpc.v1 import data_plane_pb2

Chunk = data_plane_pb2.GenerateStreamResponse


def merge_into(earlier: Chunk, later: Chunk) -> None:
    """``later``'s tokens appended to ``earlier`` (one sample, one weight version): MergeFrom
    appends repeated fields (token ids, logprobs) and keeps the newest scalars (finish reason,
    cumulative usage); text is a delta, so it is concatenated, and so are routed experts (each
    step's rows)."""
    text = earlier.text + later.text
    experts = None
    if earlier.HasField("routed_experts") and later.HasField("routed_experts"):
        experts = routed_experts.concatenate(earlier.routed_experts, later.routed_experts)
    earlier.MergeFrom(later)
    earlier.text = text
    if experts is not None:  # each step's rows, joined (MergeFrom would keep the later's)
        earlier.routed_experts.CopyFrom(experts)


def merge_backlog(
    messages: list[Chunk],
) -> list[Chunk]:
    """Messages that piled up while the reader was slow, merged so it gets fewer: a sample's
    chunks since its previous message become one, as ``ChunkCoalescer`` merges them (never
    across a weight-version change or a sample's end; chunks carrying parsed chat deltas are
    kept as they are, a delta's pieces being the parser's to split).

    A request's usage is cumulative, and a reader takes the last message's as the request's:
    a sample merged into its earlier place can leave an older count last (n samples of one
    step, the backlog starting mid-step: 45 of 48 tokens counted). Each request's last merged
    chunk carries its newest usage."""
    if len(messages) < 2:
        return messages
    merged: list[Chunk] = []
    last: dict[tuple[int, int], Chunk] = {}
    newest: dict[int, Chunk] = {}  # each request's (batch index's) newest message
    for message in messages:
        newest[message.batch_index] = message
        key = (message.batch_index, message.sample_index)
        earlier = last.get(key)
        if (
            earlier is not None
            and not earlier.finish_reason
            and earlier.weight_version == message.weight_version
            and not earlier.HasField("chat_delta")
            and not message.HasField("chat_delta")
        ):
            merge_into(earlier, message)
            continue
        merged.append(message)
        last[key] = message
    ends = {chunk.batch_index: chunk for chunk in merged}  # each request's last chunk
    for index, chunk in ends.items():
        latest = newest[index]
        if latest.HasField("usage") and chunk.usage != latest.usage:
            chunk.usage.CopyFrom(latest.usage)
    return merged
