"""GenerateMultiplex through the router (``servers.router.multiplex_relay``): a caller's one
call, each request on it placed, retried, migrated and cancelled as a GenerateStream call of its
own would be; over real sockets with stand-in backends (the subject is the router's relay) and
read with the multiplexer the trainer client uses (``skyrl_grpc.multiplex``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from skyrl_grpc.metadata import SESSION_ID
from skyrl_grpc.multiplex import Multiplexer, MuxStream
from skyrl_grpc.names import GENERATE_MULTIPLEX
from skyrl_grpc.v1 import data_plane_pb2
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.conftest import running_router
from tests.helpers.fake_backend import FakeBackend
from tests.helpers.waits import until


def request(tokens: int, **fields: object) -> data_plane_pb2.GenerateStreamRequest:
    return data_plane_pb2.GenerateStreamRequest(
        prompt_token_ids=[1, 2, 3],
        sampling_params=gen.SamplingParams(max_tokens=tokens),
        **fields,  # type: ignore[arg-type]
    )


async def read_all(stream: MuxStream) -> list[data_plane_pb2.GenerateStreamResponse]:
    chunks = []
    while (chunk := await stream.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    return chunks


@pytest.fixture
async def backends() -> AsyncIterator[list[FakeBackend]]:
    started = [await FakeBackend(f"b{i}", delay=0.01).start() for i in range(2)]
    yield started
    for backend in started:
        await backend.stop()


async def test_each_request_on_one_call_is_placed_by_its_session(
    backends: list[FakeBackend],
) -> None:
    """Twelve requests of six sessions on one call: each reads its whole stream, each session's
    requests run on one server, and both servers take some (the call is not pinned to one)."""
    async for router in running_router([b.address for b in backends]):
        async with grpc.aio.insecure_channel(router.address) as channel:
            mux = Multiplexer(channel, ())
            streams = [mux.open(request(5), session=f"s{i % 6}", parsed=True) for i in range(12)]
            results = await asyncio.gather(*(read_all(s) for s in streams))
            await mux.close()
        for chunks in results:
            assert [t for c in chunks for t in c.token_ids] == [0, 1, 2, 3, 4]
            assert chunks[-1].finish_reason == gen.FINISH_REASON_LENGTH
            assert chunks[0].request_id
        homes: dict[str, set[str]] = {}
        for backend in backends:
            for seen in backend.observed.metadata:
                homes.setdefault(seen[SESSION_ID], set()).add(backend.servicer.name)
        assert len(homes) == 6 and all(len(h) == 1 for h in homes.values()), homes
        assert all(b.observed.completed > 0 for b in backends)


async def test_a_request_whose_server_is_lost_moves_and_a_failed_one_alone_fails(
    backends: list[FakeBackend],
) -> None:
    """A server lost mid-stream: its request continues on the other, one uninterrupted
    stream; a request its server refuses fails with that status alone, the others go on.
    Each server fails its first stream after two tokens, so the request moves twice: to the
    other server, and back."""
    for backend in backends:
        backend.servicer.fail_after_tokens = 2
        backend.servicer.fail_once = True
    async for router in running_router([b.address for b in backends]):
        async with grpc.aio.insecure_channel(router.address) as channel:
            mux = Multiplexer(channel, ())
            moved = mux.open(request(6), session="moves", parsed=True)
            refused = mux.open(request(4, lora="nowhere"), session="other", parsed=True)
            tokens = [t for c in await read_all(moved) for t in c.token_ids]
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await read_all(refused)
            fine = mux.open(request(3), session="third", parsed=True)
            assert [t for c in await read_all(fine) for t in c.token_ids] == [0, 1, 2]
            await mux.close()
        # The fake counts a continuation's tokens from 0: two on each server in turn.
        assert tokens == [0, 1, 0, 1, 0, 1]
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND
        assert "nowhere" in str(failed.value.details())
        assert [e["kind"] for e in router.proxy.events.recent()].count("migration") == 2


async def test_a_cancelled_request_ends_on_its_server_and_the_call_goes_on(
    backends: list[FakeBackend],
) -> None:
    async for router in running_router([backends[0].address]):
        async with grpc.aio.insecure_channel(router.address) as channel:
            mux = Multiplexer(channel, ())
            long = mux.open(request(10_000), "", parsed=True)
            assert (await long.read()).token_ids == [0]
            assert long.cancel()
            await until(lambda: backends[0].observed.cancelled == 1, what="the request cancelled")
            short = mux.open(request(2), "", parsed=True)
            assert [t for c in await read_all(short) for t in c.token_ids] == [0, 1]
            await mux.close()
        assert backends[0].observed.in_flight == 0


async def test_a_caller_that_goes_away_has_its_requests_cancelled(
    backends: list[FakeBackend],
) -> None:
    async for router in running_router([backends[0].address]):
        async with grpc.aio.insecure_channel(router.address) as channel:
            mux = Multiplexer(channel, ())
            streams = [mux.open(request(10_000), "", parsed=True) for _ in range(3)]
            for stream in streams:
                await stream.read()
            await mux.close()  # the call cancelled
        await until(lambda: backends[0].observed.cancelled == 3, what="every request cancelled")
        assert backends[0].observed.in_flight == 0


async def test_an_index_in_use_ends_the_call_invalid_argument(
    backends: list[FakeBackend],
) -> None:
    """As on a server: the caller's bookkeeping is wrong, and its reports would mix two
    requests."""
    add = data_plane_pb2.GenerateMultiplexRequest(
        add=data_plane_pb2.GenerateBatchRequest(requests=[request(10_000)], indices=[7])
    )
    async for router in running_router([backends[0].address]):
        async with grpc.aio.insecure_channel(router.address) as channel:
            method: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(
                GENERATE_MULTIPLEX
            )
            call = method(iter([add.SerializeToString(), add.SerializeToString()]))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pass
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "[7]" in str(refused.value.details())
        await until(lambda: backends[0].observed.in_flight == 0, what="the first request ended")
