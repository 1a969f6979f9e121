"""A trainer client's generation channel to one server, probed from a testbed host:
``python -m tests.helpers.channel_probe ADDRESS LIVENESS_SECONDS CALL_SECONDS``.

It opens the channel as the client opens its direct-path ones (``ClientConfig.open_channel``
with the liveness), makes one call and prints ``READY``; then waits (up to a minute) for the
channel to lose the server (the caller cuts the link meanwhile) and prints ``LOST``; then, once
the channel tries to connect again, makes one more call, with a deadline of ``CALL_SECONDS``,
and prints ``RESULT {"code", "seconds"}``: how that call ended and how long it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable

import grpc

from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
from trainer_client.config import ClientConfig

LOST_WITHIN_SECONDS = 60.0


async def _until(
    channel: grpc.aio.Channel,
    arrived: Callable[[grpc.ChannelConnectivity], bool],
    deadline: float,
) -> grpc.ChannelConnectivity:
    """The channel's state once ``arrived`` accepts it (or at ``deadline``), an idle channel
    asked to connect meanwhile."""
    state = channel.get_state()
    while not arrived(state) and time.monotonic() < deadline:
        if state == grpc.ChannelConnectivity.IDLE:
            channel.get_state(try_to_connect=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(channel.wait_for_state_change(state), 1.0)
        state = channel.get_state()
    return state


async def probe(address: str, liveness: float, call_seconds: float) -> None:
    channel = ClientConfig(router=address).open_channel(address, liveness)
    stub = data_plane_pb2_grpc.DataPlaneStub(channel)
    request = data_plane_pb2.GetModelInfoRequest()
    await stub.GetModelInfo(request, timeout=30)
    print("READY", flush=True)
    deadline = time.monotonic() + LOST_WITHIN_SECONDS
    state = await _until(channel, lambda s: s != grpc.ChannelConnectivity.READY, deadline)
    print(f"LOST {state.name}", flush=True)
    # The channel tries the server again (CONNECTING): a call now waits on that attempt.
    state = await _until(channel, lambda s: s == grpc.ChannelConnectivity.CONNECTING, deadline)
    print(f"RECONNECTING {state.name}", flush=True)
    began = time.monotonic()
    code = "OK"
    try:
        await stub.GetModelInfo(request, timeout=call_seconds)
    except grpc.aio.AioRpcError as error:
        code = error.code().name
    result = {"code": code, "seconds": round(time.monotonic() - began, 3)}
    print(f"RESULT {json.dumps(result)}", flush=True)
    await channel.close()


if __name__ == "__main__":
    asyncio.run(probe(sys.argv[1], float(sys.argv[2]), float(sys.argv[3])))
