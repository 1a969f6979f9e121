"""No request can starve the others, against real vLLM: every limit refuses before the engine
sees the request and names its flag; Abort through the router finds a request wherever it
runs; a paused fleet is visible and behaves as documented."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from servers.engine.options import EngineOptions, RequestLimits, ServerOptions
from servers.engine.process.engine_server import EngineServer
from servers.router.proxy import ProxyOptions
from servers.router.router_server import RouterOptions, RouterServer
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import (
    control_plane_pb2_grpc,
    data_plane_pb2,
    data_plane_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    status_pb2,
    status_pb2_grpc,
)
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.helpers.waits import ENGINE_START_SECONDS, until
from trainer_client import InferenceClient

pytestmark = [pytest.mark.engine]
LIMITS = RequestLimits(
    max_n=8,
    max_prompt_tokens=64,
    max_request_id_bytes=32,
    max_logprobs=5,
    max_concurrent_samples=4,
    max_queued_requests=2,
)
SHORT = gen.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
async def limited() -> AsyncIterator[EngineServer]:
    server = EngineServer(ServerOptions(engine=EngineOptions(), limits=LIMITS))
    await server.start()
    await asyncio.wait_for(server.wait_ready(), ENGINE_START_SECONDS)
    yield server
    await server.drain(grace=1)


def stub(server: EngineServer) -> data_plane_pb2_grpc.DataPlaneAsyncStub:
    return data_plane_pb2_grpc.DataPlaneStub(grpc.aio.insecure_channel(server.address))


def generate(**fields: Any) -> data_plane_pb2.GenerateRequest:
    return data_plane_pb2.GenerateRequest(
        **{"prompt_token_ids": [1, 2, 3], "sampling_params": SHORT, **fields}
    )


REFUSALS = {
    "n": (generate(n=9), "at most 8 (--max-n)"),
    "prompt tokens": (generate(prompt_token_ids=[5] * 65), "at most 64 (--max-prompt-tokens)"),
    "message size": (generate(prompt_token_ids=[5] * 2_000_000), "(--max-prompt-tokens)"),
    "request_id": (generate(request_id="r" * 33), "at most 32 (--max-request-id-bytes)"),
    "logprobs": (
        generate(sampling_params=gen.SamplingParams(max_tokens=4, logprobs=6)),
        "(--max-logprobs)",
    ),
    "prompt logprobs": (
        generate(sampling_params=gen.SamplingParams(max_tokens=4, prompt_logprobs=6)),
        "(--max-logprobs)",
    ),
}


@pytest.mark.parametrize("limit", sorted(REFUSALS))
async def test_each_limit_refuses_before_the_engine_and_names_its_flag(
    limited: EngineServer, limit: str
) -> None:
    engine = limited.state.parts().engine
    data = stub(limited)

    async def serves() -> None:
        response = await data.Generate(generate())
        assert len(response.samples[0].token_ids) == 4

    await serves()  # warm
    started = engine.requests_started
    request, fragment = REFUSALS[limit]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await data.Generate(request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in (raised.value.details() or "")
    assert engine.requests_started == started  # the engine never saw it
    # A refusal leaves nothing queued or held: no admission slot, no request in vLLM, and the
    # next generations served (states, not timings a busy machine would miss).
    assert (limited.admission.running, limited.admission.queued) == (0, 0)
    assert engine.unfinished_requests() == 0
    await asyncio.gather(*(serves() for _ in range(3)))
    assert engine.requests_started == started + 3


async def test_a_multiplexed_add_of_more_requests_than_the_server_holds_runs_each_in_turn(
    limited: EngineServer,
) -> None:
    """A caller merges the streams it opened while it wrote into one message (``Outbox``): a
    multiplexed add is not a batch to refuse whole above the server's capacity (6 here), each
    of its requests is admitted in its turn, and the call goes on."""
    count = 10
    assert count > limited.admission.capacity
    requests = [
        data_plane_pb2.GenerateStreamRequest(prompt_token_ids=[1, 40 + i, 3], sampling_params=SHORT)
        for i in range(count)
    ]
    closed = asyncio.Event()

    async def messages() -> AsyncIterator[data_plane_pb2.GenerateMultiplexRequest]:
        add = data_plane_pb2.GenerateBatchRequest(requests=requests, indices=range(count))
        yield data_plane_pb2.GenerateMultiplexRequest(add=add)
        await closed.wait()  # the caller's side stays open until every request ended

    tokens: dict[int, int] = {}
    finished: set[int] = set()
    async with grpc.aio.insecure_channel(limited.address) as channel:
        call = data_plane_pb2_grpc.DataPlaneStub(channel).GenerateMultiplex(messages())
        async for message in call:
            assert not message.errors, message.errors
            for chunk in message.chunks:
                tokens[chunk.batch_index] = tokens.get(chunk.batch_index, 0) + len(chunk.token_ids)
                if chunk.finish_reason:
                    finished.add(chunk.batch_index)
            if len(finished) == count:
                closed.set()
        assert await call.code() == grpc.StatusCode.OK
    assert tokens == dict.fromkeys(range(count), SHORT.max_tokens)


async def test_text_that_cannot_fit_is_refused_before_the_tokenizer(limited: EngineServer) -> None:
    data = stub(limited)
    for call in (
        data.Complete(data_plane_pb2.CompleteRequest(prompt="x " * 200_000, sampling_params=SHORT)),
        data.Tokenize(data_plane_pb2.TokenizeRequest(text="x " * 200_000)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "(--max-prompt-tokens)" in (raised.value.details() or "")


async def test_beyond_the_queue_bound_requests_are_resource_exhausted(
    limited: EngineServer,
) -> None:
    data = stub(limited)
    long = gen.SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True)
    engine = limited.state.parts().engine
    running = [asyncio.ensure_future(data.Generate(generate(sampling_params=long, n=4)))]
    await until(lambda: running[0].done() or len(engine._in_flight) == 1)
    assert not running[0].done(), running[0].exception()
    queued = [
        asyncio.ensure_future(data.Generate(generate(sampling_params=long))) for _ in range(2)
    ]
    await until(
        lambda: limited.admission.queued == 2 or any(q.done() for q in queued),
        what="both requests queued for admission",
    )
    assert not any(q.done() for q in queued)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await data.Generate(generate())
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-queued-requests" in (raised.value.details() or "")
    assert "--max-concurrent-samples" in (raised.value.details() or "")
    results = await asyncio.wait_for(asyncio.gather(*running, *queued), 120)
    assert [len(r.samples) for r in results] == [4, 1, 1]


async def test_abort_without_a_session_through_the_router_reaches_either_backend(
    two_server_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    servers = [engine_server.address, second_engine_server.address]
    async with grpc.aio.insecure_channel(two_server_router.address) as channel:
        data = data_plane_pb2_grpc.DataPlaneStub(channel)
        long = gen.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        ids = [f"abort-me-{i}" for i in range(6)]
        calls = [
            data.GenerateStream(
                data_plane_pb2.GenerateStreamRequest(
                    request_id=request_id, prompt_token_ids=[1, 9, 9], sampling_params=long
                )
            )
            for request_id in ids
        ]
        firsts = await asyncio.gather(*(call.read() for call in calls))
        assert all(
            isinstance(first, data_plane_pb2.GenerateStreamResponse) and first.token_ids
            for first in firsts
        )
        backends = {dict(await call.initial_metadata())["x-skyrl-backend"] for call in calls}
        assert backends == set(servers)  # spread over both: no session pins them
        aborted = await data.Abort(data_plane_pb2.AbortRequest(request_ids=[*ids, "unknown"]))
        assert sorted(aborted.aborted_request_ids) == sorted(ids)
        for call in calls:
            last = None
            while isinstance(chunk := await call.read(), data_plane_pb2.GenerateStreamResponse):
                last = chunk
            assert last is not None and last.finish_reason == gen.FINISH_REASON_ABORTED


async def test_a_paused_fleet_is_visible_and_requests_behave_as_documented(
    two_server_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    servers = [engine_server.address, second_engine_server.address]
    client = InferenceClient(two_server_router.address, servers)
    fail_fast = RouterServer(
        RouterOptions(
            backends=servers, health_check_interval=0.2, proxy=ProxyOptions(fail_when_paused=True)
        )
    )
    await fail_fast.start()
    await fail_fast.wait_healthy(2)
    try:
        async with grpc.aio.insecure_channel(servers[0]) as channel:
            watch = status_pb2_grpc.ServerStatusStub(channel).Watch(status_pb2.WatchRequest())
            state = await watch.read()
            assert isinstance(state, status_pb2.WatchResponse) and not state.paused
            await client.pause("keep")
            state = await asyncio.wait_for(watch.read(), 5)
            assert isinstance(state, status_pb2.WatchResponse) and state.paused  # reported at once
            watch.cancel()
        async with grpc.aio.insecure_channel(two_server_router.address) as channel:
            admin = router_pb2_grpc.RouterAdminStub(channel)

            async def all_paused() -> bool:
                listed = await admin.ListBackends(router_pb2.ListBackendsRequest())
                return all(b.paused for b in listed.backends)

            await until(all_paused, what="the router to see every backend paused")
            listed = await admin.ListBackends(router_pb2.ListBackendsRequest())
            assert all(b.state == router_pb2.BACKEND_STATE_HEALTHY for b in listed.backends)
            # Default: the request waits for Resume, up to its deadline.
            data = data_plane_pb2_grpc.DataPlaneStub(channel)
            began = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await data.Generate(generate(), timeout=1.0)
            assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - began >= 0.9
        async with grpc.aio.insecure_channel(fail_fast.address) as channel:
            await until(lambda: all(b.paused for b in fail_fast.pool.backends))
            began = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await data_plane_pb2_grpc.DataPlaneStub(channel).Generate(generate(), timeout=60)
            # UNAVAILABLE, not DEADLINE_EXCEEDED: refused at once, not held to the deadline.
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "--fail-when-paused" in (raised.value.details() or "")
            assert time.monotonic() - began < 30.0
        metrics = fail_fast.metrics.registry.get_sample_value(
            "skyrl_router_worker_paused", {"worker": servers[0]}
        )
        assert metrics == 1.0
    finally:
        await client.resume()
        await fail_fast.stop(0)
    control = control_plane_pb2_grpc.ControlPlaneStub(grpc.aio.insecure_channel(servers[0]))
    assert not (await control.IsPaused(cp.IsPausedRequest())).paused
