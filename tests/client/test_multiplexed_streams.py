"""The trainer client's streams over one GenerateMultiplex call per server, or to the router
(``ClientConfig.multiplex``, ``trainer_client.stream_calls``), against a real engine server
behind a real router: the same chunks as a GenerateStream call each, one call for all of them,
deadlines and cancellation aborting the request on the server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.helpers.waits import until
from trainer_client import DeadlineExceeded, InferenceClient

pytestmark = pytest.mark.engine
GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture
async def clients(
    one_server_router: Any, engine_server: Any
) -> AsyncIterator[tuple[InferenceClient, InferenceClient]]:
    """A client multiplexing its direct streams (the default) and one that does not."""
    servers = [engine_server.address]
    multiplexed = InferenceClient(one_server_router.address, servers)
    plain = InferenceClient(one_server_router.address, servers, multiplex=False)
    for client in (multiplexed, plain):
        assert await client.connections.routes().ready()  # direct: the router's view came
    yield multiplexed, plain
    await multiplexed.close()
    await plain.close()


async def read(client: InferenceClient, prompt: list[int], sampling: dict[str, Any]) -> Any:
    """A stream's tokens, logprobs and finish reason, one message per engine step."""
    chunks = [c async for c in client.stream(prompt, sampling, stream_interval=0)]
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in c.logprobs.token_logprobs]
    return tokens, logprobs, chunks[-1].finish_reason


async def test_concurrent_streams_share_one_call_and_read_what_calls_of_their_own_read(
    clients: tuple[InferenceClient, InferenceClient], engine_server: Any
) -> None:
    multiplexed, plain = clients
    prompts = [[1, 30 + i, 7, 300 + i] for i in range(12)]
    sampling = {**GREEDY, "max_tokens": 24, "logprobs": 0}
    over_one_call = await asyncio.gather(*(read(multiplexed, p, sampling) for p in prompts))
    assert multiplexed.connections.multiplexers().addresses() == [engine_server.address]
    own_calls = await asyncio.gather(*(read(plain, p, sampling) for p in prompts))
    assert plain.connections.multiplexers().addresses() == []
    assert [len(tokens) for tokens, _, _ in over_one_call] == [24] * len(prompts)
    assert over_one_call == own_calls
    # generate() (whole samples, resubmitted after aborts) goes the same way.
    whole = await asyncio.gather(*(multiplexed.generate(p, sampling) for p in prompts))
    assert [r.token_ids for r in whole] == [tokens for tokens, _, _ in own_calls]


def unfinished(server: Any) -> int:
    """Requests in the server's vLLM engine (a frozen one counts)."""
    return int(server.state.started.engine.unfinished_requests())


async def test_a_stream_past_its_deadline_fails_and_its_request_ends_on_the_server(
    clients: tuple[InferenceClient, InferenceClient], engine_server: Any
) -> None:
    """The request is frozen on the server (pause, keep) once it runs: only the client's
    cancel at the deadline ends it there."""
    multiplexed, _ = clients
    await until(lambda: unfinished(engine_server) == 0, what="earlier requests ended")
    long = {**GREEDY, "max_tokens": 400}
    stream = multiplexed.stream([1, 2, 3], long, stream_interval=0, timeout=3.0)
    try:
        async for chunk in stream:
            if chunk.token_ids and unfinished(engine_server) == 1:
                await multiplexed.pause("keep")
                break
        with pytest.raises(DeadlineExceeded):
            async for _ in stream:
                pass
        await until(lambda: unfinished(engine_server) == 0, what="the request aborted")
    finally:
        await multiplexed.resume()
    # The call lives on for the next stream.
    tokens, _, _ = await read(multiplexed, [1, 2, 3], {**GREEDY, "max_tokens": 4})
    assert len(tokens) == 4


async def test_a_stream_left_early_ends_its_request_on_the_server(
    clients: tuple[InferenceClient, InferenceClient], engine_server: Any
) -> None:
    multiplexed, _ = clients
    await until(lambda: unfinished(engine_server) == 0, what="earlier requests ended")
    long = {**GREEDY, "max_tokens": 400}
    try:
        async with contextlib.aclosing(
            multiplexed.stream([1, 2, 4], long, stream_interval=0)
        ) as stream:
            async for chunk in stream:
                if chunk.token_ids and unfinished(engine_server) == 1:
                    await multiplexed.pause("keep")  # it would never end by itself now
                    break
        await until(lambda: unfinished(engine_server) == 0, what="the request aborted")
    finally:
        await multiplexed.resume()


async def test_streams_through_the_router_share_one_call_to_it_and_read_the_same(
    one_server_router: Any, engine_server: Any
) -> None:
    """``direct=False``: every generation goes through the router, its streams over one
    GenerateMultiplex call to it (``servers.router.multiplex_relay``), each placed with its
    session and relayed on over the router's own call to the server."""
    servers = [engine_server.address]
    routed = InferenceClient(one_server_router.address, servers, direct=False)
    plain = InferenceClient(one_server_router.address, servers, direct=False, multiplex=False)
    try:
        prompts = [[1, 40 + i, 7, 400 + i] for i in range(8)]
        sampling = {**GREEDY, "max_tokens": 16, "logprobs": 0}
        relayed = await asyncio.gather(*(read(routed, p, sampling) for p in prompts))
        assert routed.connections.multiplexers().addresses() == [one_server_router.address]
        own_calls = await asyncio.gather(*(read(plain, p, sampling) for p in prompts))
        assert plain.connections.multiplexers().addresses() == []
        assert [len(tokens) for tokens, _, _ in relayed] == [16] * len(prompts)
        assert relayed == own_calls
        # A session's requests keep its home on the router, as a call of their own would.
        await routed.generate([1, 2, 3], {**GREEDY, "max_tokens": 2}, session_id="agent-1")
        placement = one_server_router.proxy.pool.placement.sessions
        assert placement.home("agent-1") == engine_server.address
    finally:
        await routed.close()
        await plain.close()
