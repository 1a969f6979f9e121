"""Waiting for servers that are up but not serving yet.

A server that was just restarted or added answers its gRPC port at once but reports its
``ControlPlane`` NOT_SERVING (``grpc.health.v1``) until its engine is warm and it has caught up
with its peers' weights. A weight update that reached it then would fail (UNAVAILABLE) and
leave the trainer to retry; ``wait_while_starting`` waits for it instead, so the update
includes it. A server that does not answer at all is not waited for: the update reports it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from skyrl_grpc.names import CONTROL_PLANE

# How long one health check may take, and how often a starting server is asked again.
CHECK_SECONDS = 5.0
POLL_SECONDS = 0.2


async def wait_while_starting(
    channel: Callable[[str], grpc.aio.Channel], servers: Sequence[str], seconds: float
) -> list[str]:
    """Waits, up to ``seconds``, until none of ``servers`` is up and still starting; returns
    the servers still starting when the time ran out."""
    deadline = time.monotonic() + seconds

    async def starting(address: str) -> bool:
        stub = health_pb2_grpc.HealthStub(channel(address))
        request = health_pb2.HealthCheckRequest(service=CONTROL_PLANE)
        while True:
            try:
                answer = await stub.Check(request, timeout=CHECK_SECONDS)
            except grpc.aio.AioRpcError:
                return False  # unreachable, or no health service: nothing to wait for
            if answer.status != health_pb2.HealthCheckResponse.NOT_SERVING:
                return False
            if time.monotonic() >= deadline:
                return True
            await asyncio.sleep(POLL_SECONDS)

    if seconds <= 0:
        return []
    still = await asyncio.gather(*(starting(a) for a in servers))
    return [a for a, waiting in zip(servers, still, strict=True) if waiting]
