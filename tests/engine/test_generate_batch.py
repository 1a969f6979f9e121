"""GenerateBatch on real engines and real sockets: a trainer's batch as one call, a message per
engine step. Through the router a batch is split by placement and merged; each request's tokens
and logprobs are those of its single stream; a bad request fails alone; cancelling the call or
aborting one id leaves nothing running; a server killed mid-batch loses nothing; the trainer
client and the SkyRL drop-in send batched calls."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import grpc
import pytest

from servers.fleet.local import LocalFleet
from skyrl_grpc.metadata import ROUTED_TO, SESSION_ID
from skyrl_grpc.names import GENERATE_BATCH, GENERATE_STREAM
from skyrl_grpc.placement import BoundedLoadPolicy
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.helpers.streams import stream_request, tokens_of
from tests.helpers.waits import ENGINE_START_SECONDS, engines_idle, until
from trainer_client import InferenceClient

pytestmark = [pytest.mark.engine]
GREEDY = gen.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def indexed(i: int, sampling: gen.SamplingParams = GREEDY) -> data_plane_pb2.GenerateStreamRequest:
    """Request ``i``: a prompt of its own."""
    return stream_request([1, 40 + 7 * i % 1900, 9, 300 + i], sampling)


async def read_batch(
    call: Any,
) -> tuple[
    dict[int, list[data_plane_pb2.GenerateStreamResponse]], list[data_plane_pb2.BatchError], int
]:
    """Every request's chunks (by index), the errors, and how many messages came."""
    chunks: dict[int, list[data_plane_pb2.GenerateStreamResponse]] = collections.defaultdict(list)
    errors: list[data_plane_pb2.BatchError] = []
    messages = 0
    while (message := await call.read()) is not grpc.aio.EOF:
        messages += 1
        for chunk in message.chunks:
            chunks[chunk.batch_index].append(chunk)
        errors.extend(message.errors)
    return chunks, errors, messages


def logprobs_of(chunks: list[data_plane_pb2.GenerateStreamResponse]) -> list[float]:
    return [lp for c in chunks for lp in c.logprobs.token_logprobs]


async def test_a_batch_through_the_router_is_its_single_streams_and_keeps_sessions(
    two_server_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    sessions = [f"batch-episode-{i}" for i in range(64)]
    requests = [indexed(i) for i in range(64)]
    servers = (engine_server, second_engine_server)
    # Sessions earlier tests left on the shared servers count in the router's balance too
    # (read here to say, if the bound below fails, what the batch found there).
    before = {s.address: len(s.state.parts().sessions.snapshot()) for s in servers}
    async with grpc.aio.insecure_channel(two_server_router.address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)
        chunks, errors, messages = await read_batch(
            stub.GenerateBatch(
                data_plane_pb2.GenerateBatchRequest(requests=requests, session_ids=sessions)
            )
        )
        assert not errors
        # A message per engine step for the whole batch (two servers: two streams merged),
        # not a message per request per step.
        assert messages < 64 * 24 / 4
        for index, request in enumerate(requests):
            single = [
                m
                async for m in stub.GenerateStream(
                    request, metadata=((SESSION_ID, sessions[index]),)
                )
            ]
            assert tokens_of(chunks[index]) == tokens_of(single)
            # Greedy: the same tokens; logprobs equal up to the float noise of batch shapes.
            assert logprobs_of(chunks[index]) == pytest.approx(logprobs_of(single), abs=1e-4)
            assert chunks[index][0].request_id  # the server's id, on the first chunk
            assert chunks[index][-1].finish_reason == gen.FINISH_REASON_LENGTH
            assert chunks[index][-1].usage.completion_tokens == 24
    # Read at the servers: every session lives on one, and a single call carrying the session
    # is routed to that same one; the bounded-load policy held while the batch was placed.
    live = {s.address: set(s.state.parts().sessions.snapshot()) for s in servers}
    holders = {address: held & set(sessions) for address, held in live.items()}
    assert set.union(*holders.values()) == set(sessions)
    assert not set.intersection(*holders.values())
    # The bound is over every live session, the batch's and those earlier tests left: a server
    # ends over it only if it already was before the batch, and then it took none of it.
    bound = BoundedLoadPolicy().capacity(sum(map(len, live.values())), 2)
    for address, held in live.items():
        assert len(held) <= bound or not holders[address], (address, before, len(held), bound)
    async with grpc.aio.insecure_channel(two_server_router.address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)
        for session in sessions[:8]:
            call = stub.Tokenize(
                data_plane_pb2.TokenizeRequest(text="x"), metadata=((SESSION_ID, session),)
            )
            await call
            routed = dict(await call.initial_metadata())[ROUTED_TO]
            assert session in holders[str(routed)]


@pytest.mark.parametrize("path", ["router", "server"])
async def test_one_bad_prompt_among_16_fails_alone(
    two_server_router: Any, engine_server: Any, path: str
) -> None:
    requests = [indexed(i) for i in range(16)]
    requests[5].prompt_token_ids.append(999_999)  # outside the vocabulary
    address = two_server_router.address if path == "router" else engine_server.address
    async with grpc.aio.insecure_channel(address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)
        chunks, errors, _ = await read_batch(
            stub.GenerateBatch(data_plane_pb2.GenerateBatchRequest(requests=requests))
        )
    assert [(e.index, e.code) for e in errors] == [(5, INVALID_ARGUMENT)]
    assert "999999" in errors[0].message and "vocabulary" in errors[0].message
    assert sorted(chunks) == [i for i in range(16) if i != 5]
    assert all(len(tokens_of(chunks[i])) == 24 for i in chunks)


async def test_a_malformed_batch_is_refused_whole(engine_server: Any) -> None:
    async with grpc.aio.insecure_channel(engine_server.address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)
        for batch, named in [
            (data_plane_pb2.GenerateBatchRequest(), "requests is empty"),
            (
                data_plane_pb2.GenerateBatchRequest(
                    requests=[indexed(0), indexed(1)], session_ids=["only-one"]
                ),
                "session_ids has 1 entries for 2 requests",
            ),
            (
                data_plane_pb2.GenerateBatchRequest(
                    requests=[indexed(0), indexed(1)], indices=[4, 4]
                ),
                "indices repeat",
            ),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await read_batch(stub.GenerateBatch(batch))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert named in str(refused.value.details())


async def test_cancelling_a_batch_leaves_nothing_running(
    two_server_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    """The servers are paused (KEEP) once the batch runs: its requests stay on them, frozen,
    until something aborts them, so only the cancel reaching every server makes them idle
    (left to finish, the batch would end within the wait on its own)."""
    client = InferenceClient(
        two_server_router.address, [engine_server.address, second_engine_server.address]
    )
    long = gen.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    async with grpc.aio.insecure_channel(two_server_router.address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)
        call = stub.GenerateBatch(
            data_plane_pb2.GenerateBatchRequest(requests=[indexed(i, long) for i in range(16)])
        )
        await call.read()  # running
        await client.pause("keep")
        try:
            assert not await engines_idle(client)
            call.cancel()
            await until(lambda: engines_idle(client), 60, "the batch's requests aborted")
        finally:
            await client.resume()
    await client.close()


async def test_abort_by_id_ends_one_request_of_a_batch(two_server_router: Any) -> None:
    long = gen.SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    requests = [indexed(i, long) for i in range(4)]
    for i, request in enumerate(requests):
        request.request_id = f"abort-one-{i}"
    async with grpc.aio.insecure_channel(two_server_router.address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)
        call = stub.GenerateBatch(data_plane_pb2.GenerateBatchRequest(requests=requests))
        first = await call.read()
        assert isinstance(first, data_plane_pb2.GenerateBatchResponse) and first.chunks
        aborted = await stub.Abort(data_plane_pb2.AbortRequest(request_ids=["abort-one-2"]))
        assert list(aborted.aborted_request_ids) == ["abort-one-2"]
        chunks, errors, _ = await read_batch(call)
    for chunk in first.chunks:
        chunks[chunk.batch_index].insert(0, chunk)
    assert not errors
    assert chunks[2][-1].finish_reason == gen.FINISH_REASON_ABORTED
    assert len(tokens_of(chunks[2])) < 300
    assert [len(tokens_of(chunks[i])) for i in (0, 1, 3)] == [300, 300, 300]


def test_a_server_killed_mid_batch_through_the_router_loses_nothing() -> None:
    """kill -9 of the server running part of a batch: its requests move to the other server
    from their tokens so far; every request's greedy output equals an undisturbed run's."""
    max_tokens = 320
    sampling = gen.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [indexed(i, sampling) for i in range(16)]
    sessions = [f"batch-fault-{i}" for i in range(16)]

    async def scenario(fleet: LocalFleet) -> None:
        client = InferenceClient(fleet.addresses.router, fleet.addresses.servers)
        async with grpc.aio.insecure_channel(fleet.addresses.router) as channel:
            stub = data_plane_pb2_grpc.DataPlaneStub(channel)
            call = stub.GenerateBatch(
                data_plane_pb2.GenerateBatchRequest(requests=requests, session_ids=sessions)
            )
            first = await call.read()
            assert isinstance(first, data_plane_pb2.GenerateBatchResponse)
            loads = await client.server_loads()
            victim = max(fleet.addresses.servers, key=lambda s: loads[s].running_requests)
            assert loads[victim].running_requests, "no request runs on either server"
            await asyncio.to_thread(fleet.kill_server, fleet.addresses.servers.index(victim))
            chunks, errors, _ = await read_batch(call)
            for chunk in first.chunks:
                chunks[chunk.batch_index].insert(0, chunk)
            assert not errors
            survivor = next(s for s in fleet.addresses.servers if s != victim)
            async with grpc.aio.insecure_channel(survivor) as direct:
                reference, _, _ = await read_batch(
                    data_plane_pb2_grpc.DataPlaneStub(direct).GenerateBatch(
                        data_plane_pb2.GenerateBatchRequest(requests=requests)
                    )
                )
        for index in range(16):
            assert tokens_of(chunks[index]) == tokens_of(reference[index]), index
            last = chunks[index][-1]
            assert last.finish_reason == gen.FINISH_REASON_LENGTH
            assert last.usage.completion_tokens == max_tokens
            assert last.usage.prompt_tokens == len(requests[index].prompt_token_ids)
        await client.close()

    with LocalFleet(2, start_timeout=ENGINE_START_SECONDS) as fleet:
        asyncio.run(scenario(fleet))


class _Recorder(grpc.aio.UnaryStreamClientInterceptor):
    """Records the methods of the streaming calls a channel makes."""

    def __init__(self, methods: list[str]) -> None:
        self.methods = methods

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method
        self.methods.append(method.decode() if isinstance(method, bytes) else method)
        return await continuation(details, request)


@pytest.mark.parametrize("direct", [True, False], ids=["routing itself", "through the router"])
async def test_the_trainer_client_sends_a_batch_as_batched_calls(
    two_server_router: Any,
    engine_server: Any,
    second_engine_server: Any,
    monkeypatch: pytest.MonkeyPatch,
    direct: bool,
) -> None:
    methods: list[str] = []

    def recording_channel(
        self: Any, address: str, liveness_seconds: float | None = None
    ) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(address, interceptors=[_Recorder(methods)])

    monkeypatch.setattr("trainer_client.config.ClientConfig.open_channel", recording_channel)
    servers = [engine_server.address, second_engine_server.address]
    client = InferenceClient(two_server_router.address, servers, direct=direct)
    prompts = [list(indexed(i).prompt_token_ids) for i in range(64)]
    sampling = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    results = await client.generate_batch(
        prompts, sampling, session_ids=[f"client-batch-{i % 8}" for i in range(64)]
    )
    assert [len(r.token_ids) for r in results] == [24] * 64
    assert GENERATE_STREAM not in methods
    # One call per server routing itself (both hold sessions), one to the router otherwise.
    assert methods.count(GENERATE_BATCH) == (2 if direct else 1), methods
    single = await client.generate(prompts[7], sampling, session_id="client-batch-7")
    assert single.token_ids == results[7].token_ids
    await client.close()
