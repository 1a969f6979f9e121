"""A sample's weight versions never go backwards through the router: a stream, or a batch's
request, moved off a lost server continues only on one at least as new as its tokens
(``min_weight_version``), held for one when the only server left is older -- a server restarted
on its first weights, or one a partition kept from the last update (the nemesis found a stream
going on at version 0 after tokens at 4). Stand-in backends that report their weight versions;
the subject is the router."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from servers.router.router_server import RouterOptions, RouterServer
from skyrl_grpc.metadata import SESSION_ID
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.helpers.fake_backend import FakeBackend
from tests.helpers.waits import until

NEWEST = 4


@dataclass
class Fleet:
    new: FakeBackend  # serves NEWEST; the stream starts here, then it is lost
    old: FakeBackend  # serves 0: behind, until it is told otherwise
    router: RouterServer
    channel: grpc.aio.Channel


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    new = await FakeBackend("new", delay=0.2, status=True).start()
    old = await FakeBackend("old", delay=0.2, status=True).start()
    new.set_version(NEWEST)
    router = RouterServer(
        RouterOptions(backends=[new.address, old.address], health_check_interval=0.1)
    )
    await router.start()
    await router.wait_healthy(2)
    await until(
        lambda: router.pool.get(new.address).weight_version == NEWEST,
        what="the router to follow the new server's version",
    )
    new.servicer.fail_after_tokens = 2  # its first stream fails after two tokens
    new.servicer.fail_once = True
    channel = grpc.aio.insecure_channel(router.address)
    yield Fleet(new, old, router, channel)
    await channel.close()
    await router.stop(0)
    await new.stop()
    await old.stop()


def _request(max_tokens: int = 6) -> data_plane_pb2.GenerateStreamRequest:
    return data_plane_pb2.GenerateStreamRequest(
        prompt_token_ids=[1, 2], sampling_params=gen.SamplingParams(max_tokens=max_tokens)
    )


async def test_a_stream_lost_at_the_newest_version_waits_for_a_server_that_new(
    fleet: Fleet,
) -> None:
    call = data_plane_pb2_grpc.DataPlaneStub(fleet.channel).GenerateStream(
        _request(), metadata=((SESSION_ID, "s"),)
    )
    chunks = call.__aiter__()
    received: list[tuple[int, int]] = []  # (token, weight version)
    while len(received) < 2:
        chunk = await chunks.__anext__()
        received += [(t, chunk.weight_version) for t in chunk.token_ids]
    await fleet.new.set_serving(False)  # lost for good: only the old server is left
    await until(lambda: fleet.router.proxy.holding == 1, what="the continuation held")
    assert fleet.old.observed.calls == 0  # never sent where its versions would go back
    fleet.old.set_version(NEWEST)  # it caught up: the continuation goes on there
    async for chunk in chunks:
        received += [(t, chunk.weight_version) for t in chunk.token_ids]
    assert [t for t, _ in received] == [0, 1, 0, 1, 2, 3]  # the stand-in counts afresh
    assert {v for _, v in received} == {NEWEST}
    assert fleet.old.observed.calls == 1


async def test_a_continuation_no_server_can_take_says_so_and_fresh_calls_still_run(
    fleet: Fleet,
) -> None:
    fleet.router.proxy.options.hold_seconds = 0.3
    stub = data_plane_pb2_grpc.DataPlaneStub(fleet.channel)
    call = stub.GenerateStream(_request())
    chunks = call.__aiter__()
    await chunks.__anext__()
    await fleet.new.set_serving(False)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in chunks:
            pass
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    details = raised.value.details() or ""
    assert f"made at weight version {NEWEST} (min_weight_version)" in details, details
    assert f"{fleet.old.address} 0" in details and "held the call 0.3 s" in details
    assert fleet.old.observed.calls == 0
    # A new sample has no tokens to keep: the old server, the only one left, serves it.
    versions = [c.weight_version async for c in stub.GenerateStream(_request(2))]
    assert versions == [0, 0] and fleet.old.observed.calls == 1


async def test_a_batch_request_moves_only_to_a_server_as_new_as_its_tokens(fleet: Fleet) -> None:
    batch = data_plane_pb2.GenerateBatchRequest(requests=[_request()], session_ids=["s"])
    call = data_plane_pb2_grpc.DataPlaneStub(fleet.channel).GenerateBatch(batch)
    messages = call.__aiter__()
    received: list[tuple[int, int]] = []
    errors: list[str] = []
    while len(received) < 2:
        message = await messages.__anext__()
        received += [(t, c.weight_version) for c in message.chunks for t in c.token_ids]
    await fleet.new.set_serving(False)
    await until(lambda: fleet.router.proxy.holding == 1, what="the moved request held")
    assert fleet.old.observed.calls == 0
    fleet.old.set_version(NEWEST)
    async for message in messages:
        received += [(t, c.weight_version) for c in message.chunks for t in c.token_ids]
        errors += [e.message for e in message.errors]
    assert errors == []
    assert [t for t, _ in received] == [0, 1, 0, 1, 2, 3]
    assert {v for _, v in received} == {NEWEST}


async def test_a_callers_continuation_goes_on_no_older_weights_with_migration_off(
    fleet: Fleet,
) -> None:
    """A continuation the caller made (a trainer client resubmitting after an abort names its
    tokens' version) is placed by its floor even where the router would not migrate it: with
    the newest server gone, it is held and then refused UNAVAILABLE naming the floor, never
    sent to the old server (which would refuse it FAILED_PRECONDITION)."""
    fleet.router.proxy.options.max_migrations = 0
    fleet.router.proxy.options.hold_seconds = 0.3
    await fleet.new.set_serving(False)
    await until(lambda: not fleet.router.pool.serving(NEWEST), what="the new server ejected")
    continuation = _request()
    continuation.min_weight_version = NEWEST
    stub = data_plane_pb2_grpc.DataPlaneStub(fleet.channel)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.GenerateStream(continuation):
            pass
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value.details()
    assert f"made at weight version {NEWEST} (min_weight_version)" in (raised.value.details() or "")
    assert fleet.old.observed.calls == 0
