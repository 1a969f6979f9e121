"""GenerateMultiplex on a real engine and real sockets: requests join and leave one long-lived
call, a message per engine step carries every request that advanced; the router forwards
GenerateStream calls over one such call per server (the fallback to plain calls for a server
without it: test_multiplex_fallback)."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import grpc
import pytest

from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.conftest import running_router
from tests.helpers.streams import stream_request, tokens_of
from tests.helpers.waits import engines_idle, until
from trainer_client import InferenceClient

pytestmark = [pytest.mark.engine]
TOKENS = 32
GREEDY = gen.SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=1)
LONG = gen.SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)  # model: 512


def indexed(i: int, sampling: gen.SamplingParams = GREEDY) -> data_plane_pb2.GenerateStreamRequest:
    """Request ``i``: a prompt of its own."""
    return stream_request([1, 60 + 11 * i, 9, 400 + i], sampling)


def add(indices: list[int], requests: list[Any]) -> data_plane_pb2.GenerateMultiplexRequest:
    return data_plane_pb2.GenerateMultiplexRequest(
        add=data_plane_pb2.GenerateBatchRequest(requests=requests, indices=indices)
    )


async def single_stream(stub: Any, request: Any) -> list[int]:
    return tokens_of([m async for m in stub.GenerateStream(request)])


async def test_requests_join_and_leave_one_call(engine_server: Any) -> None:
    """Requests added while the call runs get their single streams' tokens; a cancelled one
    is aborted on the engine and sends nothing more; the call ends once the caller closed its
    side and the rest ended, in far fewer messages than a message per request per step."""
    client = InferenceClient(engine_server.address, [engine_server.address])
    outbox: asyncio.Queue[data_plane_pb2.GenerateMultiplexRequest | None] = asyncio.Queue()

    async def requests() -> Any:
        while (message := await outbox.get()) is not None:
            yield message

    async with grpc.aio.insecure_channel(engine_server.address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)
        call = stub.GenerateMultiplex(requests())
        outbox.put_nowait(add([0, 1, 2], [indexed(0), indexed(1, LONG), indexed(2)]))
        chunks: dict[int, list[Any]] = collections.defaultdict(list)
        messages = 0
        errors: list[Any] = []

        async def read_until(done: Any) -> None:
            nonlocal messages
            while not done():
                message = await asyncio.wait_for(call.read(), 120)
                assert isinstance(message, data_plane_pb2.GenerateMultiplexResponse), "ended early"
                messages += 1
                assert not message.errors, message.errors
                for chunk in message.chunks:
                    chunks[chunk.batch_index].append(chunk)

        await read_until(lambda: len(tokens_of(chunks[1])) >= 4)
        outbox.put_nowait(add([7], [indexed(7)]))  # joins while the others run
        outbox.put_nowait(data_plane_pb2.GenerateMultiplexRequest(cancel=[1]))
        await read_until(lambda: len(tokens_of(chunks[7])) >= TOKENS)
        cancelled_at = len(tokens_of(chunks[1]))
        outbox.put_nowait(None)  # the caller closes its side: the call ends
        while isinstance(message := await call.read(), data_plane_pb2.GenerateMultiplexResponse):
            messages += 1
            errors.extend(message.errors)
            for chunk in message.chunks:
                chunks[chunk.batch_index].append(chunk)
        assert await call.code() == grpc.StatusCode.OK
        for index in (0, 2, 7):
            assert tokens_of(chunks[index]) == await single_stream(stub, indexed(index))
            assert chunks[index][0].request_id
            assert chunks[index][-1].finish_reason == gen.FINISH_REASON_LENGTH
        # Cancelled: nothing more after the cancel took effect, not even a finish reason.
        assert len(tokens_of(chunks[1])) == cancelled_at < 480
        assert not any(c.finish_reason for c in chunks[1])
        assert not errors
        assert messages < 3 * TOKENS
    await until(lambda: engines_idle(client), 60, "the cancelled request aborted")
    await client.close()


async def test_bad_requests_fail_alone_and_a_reused_index_ends_the_call(
    engine_server: Any,
) -> None:
    async with grpc.aio.insecure_channel(engine_server.address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)
        bad = indexed(1)
        bad.prompt_token_ids.append(999_999)  # outside the vocabulary
        outbox: asyncio.Queue[Any] = asyncio.Queue()

        async def requests() -> Any:
            while (message := await outbox.get()) is not None:
                yield message

        call = stub.GenerateMultiplex(requests())
        outbox.put_nowait(add([0, 1], [indexed(0, LONG), bad]))
        first_error = None
        while first_error is None:
            message = await asyncio.wait_for(call.read(), 120)
            assert isinstance(message, data_plane_pb2.GenerateMultiplexResponse)
            first_error = message.errors[0] if message.errors else None
        assert first_error.index == 1
        assert first_error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "vocabulary" in first_error.message
        # Index 0 still runs: adding another request under it would mix two requests'
        # reports, so the call ends, saying which index and why.
        outbox.put_nowait(add([0], [indexed(5)]))
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while await call.read() is not grpc.aio.EOF:
                pass
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "indices [0] are in use" in str(ended.value.details())
        outbox.put_nowait(None)
        # The server goes on serving.
        assert len(await single_stream(stub, indexed(3))) == TOKENS


async def read_to_end(call: Any, chunks: list[data_plane_pb2.GenerateStreamResponse]) -> None:
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)


async def test_the_first_stream_on_a_call_outlives_those_that_end_before_it(
    engine_server: Any,
) -> None:
    """The first stream on a router's multiplexed call (index 0) gets every chunk to its end
    while a stream opened after it ends first. (The router once renumbered a chunk for its
    caller before it looked up whose it was: any other stream's end dropped the first one from
    the call, and its caller waited forever; an Abort through the router hung so.)"""
    longer = gen.SamplingParams(temperature=0.0, max_tokens=3 * TOKENS, ignore_eos=True)
    async for router in running_router([engine_server.address]):
        async with grpc.aio.insecure_channel(router.address) as channel:
            routed = data_plane_pb2_grpc.DataPlaneStub(channel)
            first = routed.GenerateStream(indexed(0, longer))
            head = await first.read()  # on the call (a new one: the router is new)
            assert isinstance(head, data_plane_pb2.GenerateStreamResponse)
            chunks = [head]
            later = await single_stream(routed, indexed(1))
            assert len(later) == TOKENS
            await asyncio.wait_for(read_to_end(first, chunks), 120)
            assert len(tokens_of(chunks)) == 3 * TOKENS
            assert chunks[-1].finish_reason == gen.FINISH_REASON_LENGTH


async def test_the_router_multiplexes_streams_to_a_server(engine_server: Any) -> None:
    """32 concurrent GenerateStream calls through the router travel over one multiplexed call
    to the server; each caller gets its own stream's tokens, logprobs and finish reason, a
    refused request its status, and cancelling one caller's call aborts its request on the
    server."""
    watcher = InferenceClient(engine_server.address, [engine_server.address])
    async for router in running_router([engine_server.address]):
        async with (
            grpc.aio.insecure_channel(router.address) as via_router,
            grpc.aio.insecure_channel(engine_server.address) as direct,
        ):
            routed = data_plane_pb2_grpc.DataPlaneStub(via_router)
            server = data_plane_pb2_grpc.DataPlaneStub(direct)
            long_call = routed.GenerateStream(indexed(99, LONG))
            await long_call.read()
            assert router.proxy.multiplexers.addresses() == [engine_server.address]
            results = await asyncio.gather(*(single_stream(routed, indexed(i)) for i in range(32)))
            for i, tokens in enumerate(results):
                assert tokens == await single_stream(server, indexed(i))
            # A request the server refuses fails its caller's call with the server's status.
            bad = indexed(50)
            bad.prompt_token_ids.append(999_999)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await single_stream(routed, bad)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "vocabulary" in str(refused.value.details())
            long_call.cancel()
        await until(lambda: engines_idle(watcher), 60, "the cancelled stream aborted on the server")
    await watcher.close()


async def test_a_draining_server_ends_a_callers_multiplexed_call_once_its_requests_end(
    tiny_model_dir: Any,
) -> None:
    """A caller (router, client) keeps its call open between requests. A draining server
    refuses what is added now (UNAVAILABLE: to be sent elsewhere), lets the running request
    finish, and ends the call itself then, rather than holding the drain for its grace."""
    from servers.engine.options import EngineOptions, ServerOptions
    from servers.engine.process.engine_server import EngineServer
    from skyrl_grpc.multiplex import Multiplexer

    grace = 60.0
    server = EngineServer(ServerOptions(engine=EngineOptions(), drain_grace_seconds=grace))
    await server.start()
    draining: asyncio.Future[None] | None = None
    try:
        await asyncio.wait_for(server.wait_ready(), 300)
        async with grpc.aio.insecure_channel(server.address) as channel:
            mux = Multiplexer(channel, ())
            idle = mux.open(indexed(0), "", parsed=True)
            while (await idle.read()) is not grpc.aio.EOF:  # done: the call stays open
                pass
            running = mux.open(indexed(1, LONG), "", parsed=True)
            first = await running.read()
            assert first.token_ids
            draining = asyncio.ensure_future(server.drain())
            await until(lambda: server.state.draining)
            late = mux.open(indexed(2), "", parsed=True)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await late.read()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in (refused.value.details() or "")
            tokens = list(first.token_ids)
            while (chunk := await running.read()) is not grpc.aio.EOF:
                tokens.extend(chunk.token_ids)
            assert len(tokens) == LONG.max_tokens  # the running request finished whole
            await asyncio.wait_for(asyncio.shield(draining), grace / 2)  # not held for the grace
            await until(lambda: mux.failed is not None, what="the call's end read")
            assert mux.failed is not None
            assert mux.failed.details() == "the multiplexed call ended"  # ended by the server
    finally:
        if draining is None:
            await server.drain(grace=1)
        else:
            await draining  # within the grace whatever happened
