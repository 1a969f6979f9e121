"""Chunks that wait for a slow reader leave as one message per sample (``merge_backlog``, used by
the engine server's streams and the router's multiplexed streams): the same tokens, text,
logprobs and finish reason as the chunks one by one, never merged across a weight-version
change, a sample's end or a parsed chat delta."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from skyrl_grpc.multiplex import MuxStream
from skyrl_grpc.stream_chunks import merge_backlog
from skyrl_grpc.v1 import chat_tools_pb2 as chat
from skyrl_grpc.v1 import data_plane_pb2 as pb
from skyrl_grpc.v1 import generation_pb2 as gen

Chunk = pb.GenerateStreamResponse


def chunk(sample: int, token: int, version: int = 1, **fields: Any) -> Chunk:
    message = Chunk(
        sample_index=sample,
        token_ids=[token],
        text=f"<{token}>",
        weight_version=version,
        logprobs=gen.Logprobs(token_logprobs=[-token / 10]),
        **fields,
    )
    return message


def assembled(messages: list[Chunk]) -> dict[int, tuple[list[int], str, list[float], int]]:
    """Per sample: its token ids, text, logprobs and finish reason, read message by message."""
    out: dict[int, tuple[list[int], str, list[float], int]] = {}
    for m in messages:
        ids, text, logprobs, _ = out.get(m.sample_index, ([], "", [], 0))
        out[m.sample_index] = (
            ids + list(m.token_ids),
            text + m.text,
            logprobs + list(m.logprobs.token_logprobs),
            m.finish_reason,
        )
    return out


def test_a_backlog_of_two_samples_becomes_a_message_each_with_the_same_contents() -> None:
    stop = gen.FINISH_REASON_LENGTH
    waiting = [chunk(0, 1), chunk(1, 2), chunk(0, 3), chunk(1, 4), chunk(0, 5, finish_reason=stop)]
    expected = assembled([Chunk.FromString(c.SerializeToString()) for c in waiting])
    merged = merge_backlog(waiting)
    assert len(merged) == 2
    assert assembled(merged) == expected
    assert merged[0].text == "<1><3><5>" and merged[0].finish_reason == stop


def test_a_backlog_begun_mid_step_ends_with_each_requests_newest_usage() -> None:
    """Usage is cumulative and read from the last message: n=3 samples, the backlog starting
    after sample 0's chunk of a step. Merged in first-appearance order (1, 2, 0), sample 0's
    chunk ends the list; it carries the newest count (a clean-clone CI run read 45 of 48)."""
    waiting, counted = [], 0
    for step, sample in [(1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]:
        counted += 1
        waiting.append(
            chunk(sample, 10 * step + sample, usage=gen.Usage(completion_tokens=counted))
        )
    other = chunk(0, 99, batch_index=1, usage=gen.Usage(completion_tokens=7))  # another request's
    merged = merge_backlog([*waiting[:3], other, *waiting[3:]])
    assert [(m.batch_index, m.sample_index) for m in merged] == [(0, 1), (0, 2), (0, 0), (1, 0)]
    assert merged[2].usage.completion_tokens == 5  # this request's newest, on its last chunk
    assert merged[3].usage.completion_tokens == 7  # the other request keeps its own


def test_no_merge_across_a_version_change_a_finish_or_a_chat_delta() -> None:
    stop = gen.FINISH_REASON_STOP
    across_version = merge_backlog([chunk(0, 1, version=1), chunk(0, 2, version=2)])
    assert [list(m.token_ids) for m in across_version] == [[1], [2]]
    after_finish = merge_backlog([chunk(0, 1, finish_reason=stop), chunk(0, 2)])
    assert len(after_finish) == 2
    delta = chat.ChatDelta(content="hi")
    with_delta = merge_backlog([chunk(0, 1, chat_delta=delta), chunk(0, 2, chat_delta=delta)])
    assert len(with_delta) == 2


class _Mux:
    answered = True

    def cancel(self, index: int) -> None:
        raise AssertionError("nothing cancels here")


async def test_a_router_stream_read_late_gets_its_text_chunks_as_one_message() -> None:
    stream = MuxStream(_Mux(), 0, samples=1)  # type: ignore[arg-type]
    for token in (1, 2, 3):
        stream.deliver(chunk(0, token))
    stream.deliver(chunk(0, 4, finish_reason=gen.FINISH_REASON_LENGTH))
    first = Chunk.FromString(await stream.read())
    assert list(first.token_ids) == [1, 2, 3, 4] and first.text == "<1><2><3><4>"
    assert first.finish_reason == gen.FINISH_REASON_LENGTH
    assert await stream.read() is grpc.aio.EOF


async def test_a_router_stream_read_on_time_gets_a_message_per_chunk() -> None:
    stream = MuxStream(_Mux(), 0, samples=1)  # type: ignore[arg-type]
    read: list[Chunk] = []
    for token in (1, 2):
        stream.deliver(chunk(0, token))
        read.append(Chunk.FromString(await asyncio.wait_for(stream.read(), 5)))
    assert [list(m.token_ids) for m in read] == [[1], [2]]
