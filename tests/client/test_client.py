"""The trainer client against real engine servers behind a real router."""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
from typing import Any

import pytest

from tests.helpers.streams import unused_address
from tests.helpers.waits import failing_while_paused, running_on_engines, until
from trainer_client import (
    BlockingInferenceClient,
    FanOutError,
    FinishReason,
    InferenceClient,
    InvalidArgument,
    ServerError,
)

pytestmark = [pytest.mark.engine]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def prompts(count: int, offset: int = 0) -> list[list[int]]:
    return [[1, 40 + i + offset, 500 + 3 * i, 77] for i in range(count)]


@pytest.fixture
def client(
    two_server_router: Any, engine_server: Any, second_engine_server: Any
) -> InferenceClient:
    # Through the router: these tests read the router's counters (the direct path has its
    # own tests in test_direct_routing.py).
    return InferenceClient(
        two_server_router.address,
        [engine_server.address, second_engine_server.address],
        direct=False,
    )


async def test_batch_results_in_input_order_and_sessions_pinned(
    client: InferenceClient, two_server_router: Any
) -> None:
    batch = prompts(6)
    expected = [await client.generate(p, {**GREEDY, "max_tokens": 12}) for p in batch]
    before = {b.address: b.total_requests for b in two_server_router.pool.backends}
    results = await client.generate_batch(
        batch, {**GREEDY, "max_tokens": 12}, session_ids=["rollout-7"] * 6
    )
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert [r.prompt_token_ids for r in results] == batch
    after = {b.address: b.total_requests for b in two_server_router.pool.backends}
    grown = [a for a in after if after[a] > before[a]]
    assert grown == [two_server_router.pool.owner("rollout-7")]
    assert after[grown[0]] - before[grown[0]] == 6


async def test_sample_without_session_spreads_by_load(
    client: InferenceClient, two_server_router: Any
) -> None:
    before = {b.address: b.total_requests for b in two_server_router.pool.backends}
    samples = await client.sample(
        prompts(1)[0], {"temperature": 1.0, "max_tokens": 64, "ignore_eos": True}, n=8
    )
    assert len(samples) == 8 and all(len(s.token_ids) == 64 for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1
    after = {b.address: b.total_requests for b in two_server_router.pool.backends}
    assert all(after[a] > before[a] for a in after)  # both servers took some


async def test_seeded_samples_are_each_drawn_with_a_seed_of_their_own(
    client: InferenceClient,
) -> None:
    """``sample(n)`` with a seed: sample i is drawn with seed + i, as vLLM seeds the n samples of
    one request (the same seed on every copy gave one sample n times)."""
    sampling = {"temperature": 1.0, "max_tokens": 16, "ignore_eos": True, "seed": 11}
    samples = await client.sample(prompts(1)[0], sampling, n=4)
    assert len({tuple(s.token_ids) for s in samples}) == 4, [s.token_ids for s in samples]


async def test_pause_abort_mid_batch_then_resume_loses_and_duplicates_nothing(
    client: InferenceClient,
) -> None:
    batch = prompts(8, offset=100)
    sampling = {**GREEDY, "max_tokens": 300, "logprobs": 0}
    uninterrupted = [await client.generate(p, sampling) for p in batch]
    running = asyncio.ensure_future(
        client.generate_batch(batch, sampling, session_ids=[f"s{i}" for i in range(8)])
    )
    # At least one running (waiting for all eight raced their end in one CI run: the tiny
    # model finishes 300 tokens fast); the pause must still abort something (asserted below).
    await running_on_engines(client, 1, running)
    await client.pause("abort")
    assert await client.all_paused()

    async def resubmitted() -> bool:
        assert not running.done(), "the batch ended during the pause"
        loads = await client.server_loads()
        return sum(load.waiting_requests for load in loads.values()) > 0

    # Aborted generations wait for resume, resubmitted and queued on the paused servers (a
    # client that gave up on them instead would end the batch, or queue nothing).
    await until(resubmitted, what="the aborted generations queued for resume")
    assert not running.done()
    await client.resume()
    results = await asyncio.wait_for(running, 60)
    assert sum(r.abort_retries for r in results) > 0, "the pause aborted nothing"
    for result, reference in zip(results, uninterrupted, strict=True):
        assert result.token_ids == reference.token_ids
        assert len(result.token_ids) == 300 and result.finish_reason == FinishReason.LENGTH
        assert result.logprobs == pytest.approx(reference.logprobs, abs=1e-3)


async def test_fan_out_to_three_servers_with_one_down_names_it(
    two_server_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    dead = unused_address()
    live = [engine_server.address, second_engine_server.address]
    client = InferenceClient(two_server_router.address, [*live, dead], control_timeout=3)
    with pytest.raises(FanOutError) as raised:
        await client.server_info()
    error = raised.value
    assert set(error.failures) == {dead} and set(error.results) == set(live)
    assert dead in str(error) and all(a in str(error) for a in live)
    assert error.failures[dead].code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    assert all(info.world_size == 1 for info in error.results.values())
    healthy = InferenceClient(two_server_router.address, live)
    assert await healthy.world_size() == 2
    assert (await healthy.is_paused()) == dict.fromkeys(live, False)


async def test_chat_complete_tokenize_through_router(client: InferenceClient) -> None:
    reply = await client.chat([{"role": "user", "content": "hello"}], {**GREEDY, "max_tokens": 6})
    assert len(reply.token_ids) == 6 and reply.text is not None
    assert reply.text == await client.detokenize(reply.token_ids)
    done = await client.complete("The router", {**GREEDY, "max_tokens": 5})
    assert done.prompt_token_ids == await client.tokenize("The router")
    chunks = [c async for c in client.stream([1, 2, 3], {**GREEDY, "max_tokens": 7})]
    assert sum(len(c.token_ids) for c in chunks) == 7
    with pytest.raises(InvalidArgument) as raised:  # a ServerError of its status
        await client.generate([1, 99999])
    assert isinstance(raised.value, ServerError)
    assert (
        raised.value.code.name == "INVALID_ARGUMENT"
        and raised.value.address == client.config.router
    )


def _child(payload: bytes, queue: Any) -> None:
    client = pickle.loads(payload)
    result = client.generate([1, 2, 3], {"temperature": 0.0, "max_tokens": 5})
    client.pause("keep")
    paused = client.all_paused()
    client.resume()
    queue.put((result.token_ids, paused, client.all_paused()))


async def test_pickled_client_generates_and_pauses_in_another_process(
    two_server_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    client = BlockingInferenceClient(
        two_server_router.address, [engine_server.address, second_engine_server.address]
    )
    payload = pickle.dumps(client)
    assert len(payload) < 1000  # addresses and settings only
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(payload, queue))
    process.start()
    tokens, paused, still_paused = await asyncio.to_thread(queue.get, True, 120)
    await asyncio.to_thread(process.join, 30)
    reference = await client.async_client.generate([1, 2, 3], {"temperature": 0.0, "max_tokens": 5})
    assert tokens == reference.token_ids and paused is True and still_paused is False


def _live(kind: type) -> int:
    import gc

    gc.collect()
    # A finished task kept by a reference somewhere is not running work: count live ones.
    return sum(
        isinstance(o, kind) and not (isinstance(o, asyncio.Task) and o.done())
        for o in gc.get_objects()
    )


async def test_a_client_used_from_a_new_event_loop_every_step_leaks_nothing(
    two_server_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    # A trainer that calls asyncio.run(client.generate(...)) once per step: every loop's
    # channels and routing feed must end with it.
    import os

    import grpc

    from trainer_client.direct import DirectRoutes

    client = InferenceClient(
        two_server_router.address, [engine_server.address, second_engine_server.address]
    )

    def steps(count: int) -> None:
        for step in range(count):
            result = asyncio.run(client.generate([1, 2, 3 + step % 50], {"max_tokens": 2}))
            assert len(result.token_ids) == 2

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    await asyncio.to_thread(steps, 5)  # warm: grpc's own threads and sockets exist now
    before = (open_fds(), _live(grpc.aio.Channel), _live(DirectRoutes), _live(asyncio.Task))
    await asyncio.to_thread(steps, 200)
    after = (open_fds(), _live(grpc.aio.Channel), _live(DirectRoutes), _live(asyncio.Task))
    # File descriptors, channels, routing feeds and tasks flat: a leak adds one per step, 200
    # in all. Tasks get more slack: the in-process servers' own tasks live in this process.
    slack = (3, 3, 3, 20)
    assert all(a <= b + s for a, b, s in zip(after, before, slack, strict=True)), (before, after)


async def test_closing_a_blocking_client_ends_its_loop_and_thread(
    two_server_router: Any, engine_server: Any
) -> None:
    # In a thread: the in-process servers serve on this test's event loop.
    def scenario() -> None:
        client = BlockingInferenceClient(two_server_router.address, [engine_server.address])
        assert len(client.generate([1, 2, 3], {"max_tokens": 2}).token_ids) == 2
        loop, thread = client._loop, client._thread
        assert loop is not None and thread is not None
        client.close()
        assert loop.is_closed() and not thread.is_alive()
        assert len(client.generate([1, 2, 3], {"max_tokens": 2}).token_ids) == 2  # usable again
        client.close()

    await asyncio.wait_for(asyncio.to_thread(scenario), 120)


async def test_one_failing_prompt_cancels_the_rest_of_its_batch(
    two_server_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    client = InferenceClient(
        two_server_router.address, [engine_server.address, second_engine_server.address]
    )
    batch = [*prompts(6, offset=300), [1, 99999]]  # the last one is out of the vocabulary
    error = await failing_while_paused(
        client, client.generate_batch(batch, {**GREEDY, "max_tokens": 200})
    )
    assert isinstance(error, ServerError) and error.code.name == "INVALID_ARGUMENT"
