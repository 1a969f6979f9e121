"""A multiplexed call's outbox (``skyrl_grpc.multiplex.Outbox``): what waited while a write was
under way leaves as one message, in order, and nothing is merged that must go alone."""

from __future__ import annotations

import asyncio

from skyrl_grpc.multiplex import MERGED_REQUESTS, Outbox
from skyrl_grpc.v1 import data_plane_pb2


def opened(index: int, session: str = "") -> data_plane_pb2.GenerateMultiplexRequest:
    """What ``Multiplexer.open`` puts: one request, its session and its index."""
    request = data_plane_pb2.GenerateStreamRequest(request_id=f"r{index}", prompt_token_ids=[1])
    add = data_plane_pb2.GenerateBatchRequest(
        requests=[request], session_ids=[session], indices=[index]
    )
    return data_plane_pb2.GenerateMultiplexRequest(add=add)


def cancelled(index: int) -> data_plane_pb2.GenerateMultiplexRequest:
    return data_plane_pb2.GenerateMultiplexRequest(cancel=[index])


async def test_what_waited_leaves_as_one_message_in_order() -> None:
    outbox = Outbox()
    for waiting in (opened(0, "a"), opened(1), cancelled(7), opened(2, "b")):
        outbox.put(waiting)
    message = await outbox.take()
    assert message is not None
    assert [r.request_id for r in message.add.requests] == ["r0", "r1", "r2"]
    assert list(message.add.session_ids) == ["a", "", "b"]  # each still beside its request
    assert list(message.add.indices) == [0, 1, 2]
    assert list(message.cancel) == [7]
    outbox.close()
    assert await outbox.take() is None


async def test_a_message_carrying_its_trace_context_goes_alone() -> None:
    outbox = Outbox()
    traced = opened(1)
    traced.trace_context["traceparent"] = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    for waiting in (opened(0), traced, opened(2), opened(3)):
        outbox.put(waiting)
    taken = [await outbox.take() for _ in range(3)]
    assert [[r.request_id for r in m.add.requests] for m in taken if m is not None] == [
        ["r0"],
        ["r1"],
        ["r2", "r3"],
    ]
    assert taken[1] is not None and dict(taken[1].trace_context) == dict(traced.trace_context)


async def test_a_burst_is_cut_at_the_merge_bound_and_close_comes_after_what_waited() -> None:
    outbox = Outbox()
    for index in range(MERGED_REQUESTS + 3):
        outbox.put(opened(index))
    outbox.close()
    first, second = await outbox.take(), await outbox.take()
    assert first is not None and second is not None
    assert list(first.add.indices) == list(range(MERGED_REQUESTS))
    assert list(second.add.indices) == list(range(MERGED_REQUESTS, MERGED_REQUESTS + 3))
    assert await outbox.take() is None


async def test_take_waits_for_a_message() -> None:
    outbox = Outbox()
    taking = asyncio.ensure_future(outbox.take())
    await asyncio.sleep(0)
    assert not taking.done()  # nothing to take yet: it waits (an event, not a poll)
    outbox.put(opened(5))
    message = await asyncio.wait_for(taking, 10)
    assert message is not None and list(message.add.indices) == [5]
