"""The router in front of a real vLLM engine server: cancel and deadline reach the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from skyrl_grpc.metadata import ROUTED_TO, SESSION_ID
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc, data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.helpers.waits import engine_idle

pytestmark = [pytest.mark.engine]


@pytest.fixture(scope="module")
async def routed(
    engine_server: Any, one_server_router: Any
) -> AsyncIterator[tuple[grpc.aio.Channel, control_plane_pb2_grpc.ControlPlaneAsyncStub]]:
    async with (
        grpc.aio.insecure_channel(one_server_router.address) as channel,
        grpc.aio.insecure_channel(engine_server.address) as direct,
    ):
        yield channel, control_plane_pb2_grpc.ControlPlaneStub(direct)


LONG = gen.SamplingParams(temperature=0.0, max_tokens=450, ignore_eos=True)


async def test_greedy_through_router_equals_direct(
    routed: Any, engine_channel: grpc.aio.Channel
) -> None:
    channel, _ = routed
    request = data_plane_pb2.GenerateRequest(
        prompt_token_ids=[1, 45, 722, 84],
        sampling_params=gen.SamplingParams(temperature=0.0, max_tokens=16),
    )
    call = data_plane_pb2_grpc.DataPlaneStub(channel).Generate(
        request, metadata=((SESSION_ID, "s"),)
    )
    through_router = await call
    assert ROUTED_TO in dict(await call.initial_metadata())
    direct = await data_plane_pb2_grpc.DataPlaneStub(engine_channel).Generate(request)
    assert list(through_router.samples[0].token_ids) == list(direct.samples[0].token_ids)


async def test_cancel_through_router_aborts_on_engine(routed: Any) -> None:
    """The engine is paused (KEEP) once the stream runs: the request stays on it, frozen, until
    something aborts it, so only the cancel reaching the engine through the router makes it
    idle (left to finish, a 450-token stream would end within the wait on its own)."""
    channel, control = routed
    call = data_plane_pb2_grpc.DataPlaneStub(channel).GenerateStream(
        data_plane_pb2.GenerateStreamRequest(prompt_token_ids=[1, 2, 3], sampling_params=LONG)
    )
    await call.read()
    await control.Pause(cp.PauseRequest(mode=cp.PAUSE_MODE_KEEP))
    try:
        load = await control.GetLoad(cp.GetLoadRequest())
        assert load.running_requests + load.waiting_requests == 1
        call.cancel()
        await engine_idle(control)
    finally:
        await control.Resume(cp.ResumeRequest())


async def test_deadline_through_router_is_deadline_exceeded_and_engine_idle(routed: Any) -> None:
    """As above: the request is frozen on the paused engine when its deadline passes, so only
    the deadline reaching the engine through the router ends it."""
    channel, control = routed
    stream = data_plane_pb2_grpc.DataPlaneStub(channel).GenerateStream(
        data_plane_pb2.GenerateStreamRequest(prompt_token_ids=[1, 2, 3], sampling_params=LONG),
        timeout=2,
    )
    await stream.read()
    await control.Pause(cp.PauseRequest(mode=cp.PAUSE_MODE_KEEP))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            while await stream.read() is not grpc.aio.EOF:  # one read API on one call
                pass
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await engine_idle(control)
    finally:
        await control.Resume(cp.ResumeRequest())
