"""Sessions end where they live, and no request reuses KV computed under other weights.

The session table of an engine server (plain class, then real servers behind a router): a
request with ``x-session-id`` makes the session live on its server, ``FinishSession`` frees
its place at the server and the router, idleness ends it on its own. And the prefix-cache
isolation the contract promises: after a KEEP pause with requests holding cached blocks (the
cache reset cannot run), a request sharing their prefix answers exactly as a fresh engine
started on the new weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
from safetensors.torch import load_file, save_file

from servers.engine.domain.live_sessions import LiveSessions
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc, status_pb2, status_pb2_grpc
from tests.conftest import offline_reference
from tests.helpers.waits import until
from tests.helpers.weights import SHARED_PREFIX, perturbed, update_while_a_prefix_is_held
from trainer_client import InferenceClient

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_session_lives_until_finished_or_idle() -> None:
    clock = Clock()
    sessions = LiveSessions(idle_seconds=60, clock=clock)
    assert sessions.touch("a") is True
    assert sessions.touch("a") is False  # a later turn of a live session
    sessions.touch("b")
    clock.now = 50
    sessions.touch("b")  # renewed
    clock.now = 61
    assert sessions.expire() == ["a"]
    assert sessions.snapshot() == {"b"}
    assert sessions.finish("b") is True
    assert sessions.finish("b") is False
    assert len(sessions) == 0


async def first_status(address: str) -> status_pb2.WatchResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        call = status_pb2_grpc.ServerStatusStub(channel).Watch(status_pb2.WatchRequest())
        async for status in call:
            call.cancel()
            return status
    raise AssertionError(f"{address} sent no status")


async def router_sessions(router: str) -> dict[str, int]:
    async with grpc.aio.insecure_channel(router) as channel:
        listed = await router_pb2_grpc.RouterAdminStub(channel).ListBackends(
            router_pb2.ListBackendsRequest()
        )
    return {b.address: b.live_sessions for b in listed.backends}


@pytest.mark.engine
async def test_finish_session_frees_its_place_at_the_server_and_the_router(
    two_server_router: Any,
) -> None:
    client = InferenceClient(two_server_router.address)
    session = "finish-me"
    await client.generate([1, 5, 6, 7], GREEDY, session_id=session)
    home = two_server_router.pool.owner(session)
    status = await first_status(home)
    assert status.sessions_complete and session in status.sessions_added
    assert status.live_sessions == len(status.sessions_added)
    held = (await router_sessions(two_server_router.address))[home]
    assert held >= 1

    assert await client.finish_session(session) is True
    assert session not in (await first_status(home)).sessions_added

    directory = two_server_router.pool.placement.sessions

    async def released() -> bool:
        # "at most": other tests' sessions may end by idleness meanwhile
        counted = (await router_sessions(two_server_router.address))[home]
        return counted <= held - 1 and session not in directory.snapshot()

    await until(released, what="the router to stop counting the finished session")
    assert await client.finish_session(session) is False  # nothing left to end
    await client.close()


@pytest.mark.engine
async def test_a_new_session_goes_to_the_server_holding_fewer(two_server_router: Any) -> None:
    """Bounded-load placement (the router's default): whichever server holds fewer live
    sessions takes the next new one.

    Other tests' sessions live on the shared servers and end by idleness while this runs (the
    suite outlasts ``SESSION_IDLE_SECONDS``), so each placement is judged against the counts
    read just before it, and only where nothing but that placement changed them meanwhile."""
    client = InferenceClient(two_server_router.address)
    placed = [f"spread-{i}" for i in range(8)]
    judged = 0
    for i, session in enumerate(placed):
        before = await router_sessions(two_server_router.address)
        await client.generate([1, 40 + i, 7], GREEDY, session_id=session)
        home = two_server_router.pool.owner(session)
        assert home is not None
        after = await router_sessions(two_server_router.address)
        if after != {**before, home: before[home] + 1}:
            continue  # another session ended (or began) beside this one
        judged += 1
        assert before[home] == min(before.values()), (session, home, before)
    assert judged >= len(placed) // 2, "other sessions kept changing the counts"
    for session in placed:
        await client.finish_session(session)
    await client.close()


@pytest.mark.engine
async def test_prefix_cache_hits_are_counted_per_request_and_by_the_router(
    two_server_router: Any,
) -> None:
    client = InferenceClient(two_server_router.address)
    session = "cache-counter"
    prefix = [1, *range(1000, 1300)]  # two full cache blocks and more
    first = await client.generate([*prefix, 5], GREEDY, session_id=session)
    second = await client.generate([*prefix, 6], GREEDY, session_id=session)
    assert second.cached_prompt_tokens >= 256 > first.cached_prompt_tokens
    home = two_server_router.pool.owner(session)
    backend = two_server_router.pool.get(home)

    await until(
        lambda: backend.status.cached_prompt_tokens >= second.cached_prompt_tokens,
        what="the server's status to report its cached prompt tokens",
    )
    assert backend.status.prompt_tokens >= len(prefix) * 2
    await client.finish_session(session)
    await client.close()


@pytest.mark.engine
async def test_after_a_keep_pause_update_a_shared_prefix_answers_as_the_new_weights(
    engine_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Requests holding the prefix's blocks are paused in KEEP mode, so the prefix-cache reset
    after the update cannot free them; the next request with that prefix must still compute
    it under the new weights (its output equals a fresh engine's on them), and later requests
    reuse the new blocks."""
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    new_weights = perturbed(original, 41)
    fresh_dir = tmp_path / "new-weights"
    shutil.copytree(tiny_model_dir, fresh_dir)
    save_file(new_weights, str(fresh_dir / "model.safetensors"))
    probe = [*SHARED_PREFIX, 777]
    sampling = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    (fresh,) = offline_reference(fresh_dir, [probe], sampling, tmp_path)

    address = engine_server.address
    client = InferenceClient(address, [address])
    try:
        before = await client.generate(probe, sampling)
        assert before.token_ids != fresh["token_ids"], "the new weights change nothing"
        holding = await update_while_a_prefix_is_held(client, new_weights)
        after = await client.generate(probe, sampling)
        again = await client.generate([*SHARED_PREFIX, 778], sampling)
        await holding
        assert after.token_ids == fresh["token_ids"]
        assert after.cached_prompt_tokens == 0  # the old blocks are not reused...
        assert again.cached_prompt_tokens >= 256  # ...while blocks of the new weights are
    finally:
        await client.resume()
        await client.update_weights(original.items(), transport="grpc")
        await client.close()
