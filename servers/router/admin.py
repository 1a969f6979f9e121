"""RouterAdmin servicer: backend membership at runtime, over the BackendPool, and the routing
view clients follow to route data-plane calls themselves (WatchBackends)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

from skyrl_grpc.v1 import router_pb2, router_pb2_grpc

from ..common.grpc_types import Context
from ..common.validate import host_port
from .backends import BackendPool

# How often the routing view is compared with what a watcher last got (its update rate cap).
FEED_INTERVAL_SECONDS = 0.05
# A message at least this often even when nothing changed, so watchers know the feed lives.
FEED_HEARTBEAT_SECONDS = 5.0


def routing_fields(backend: router_pb2.Backend) -> tuple[object, ...]:
    """What placement reads of a backend: a change of these is worth an update."""
    return (
        backend.address,
        backend.state,
        backend.paused,
        backend.running_requests + backend.waiting_requests,
        backend.live_sessions,
    )


class RouterAdminServicer(router_pb2_grpc.RouterAdminServicer):
    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool

    async def ListBackends(
        self,
        request: router_pb2.ListBackendsRequest,
        context: Context,
    ) -> router_pb2.ListBackendsResponse:
        return router_pb2.ListBackendsResponse(backends=self._pool.describe())

    async def AddBackend(
        self,
        request: router_pb2.AddBackendRequest,
        context: Context,
    ) -> router_pb2.AddBackendResponse:
        backend = self._pool.add(host_port(request.address))
        return router_pb2.AddBackendResponse(backend=self._pool.describe([backend])[0])

    async def RemoveBackend(
        self,
        request: router_pb2.RemoveBackendRequest,
        context: Context,
    ) -> router_pb2.RemoveBackendResponse:
        await self._pool.remove(request.address)
        return router_pb2.RemoveBackendResponse()

    async def DrainBackend(
        self,
        request: router_pb2.DrainBackendRequest,
        context: Context,
    ) -> router_pb2.DrainBackendResponse:
        remaining = await self._pool.drain(request.address, context.time_remaining())
        return router_pb2.DrainBackendResponse(remaining_in_flight=remaining)

    async def WatchBackends(
        self,
        request: router_pb2.WatchBackendsRequest,
        context: Context,
    ) -> AsyncIterator[router_pb2.WatchBackendsResponse]:
        placement = self._pool.placement
        epsilon = getattr(placement, "epsilon", 0.0)
        sent_sessions: dict[str, str] = {}
        sent_backends: list[tuple[object, ...]] | None = None
        last_sent = 0.0
        loop = asyncio.get_running_loop()
        while True:
            backends = self._pool.describe()
            view = [routing_fields(b) for b in backends]
            sessions = placement.sessions.snapshot()
            added = [
                router_pb2.SessionPlacement(session_id=s, address=a)
                for s, a in sessions.items()
                if sent_sessions.get(s) != a
            ]
            removed = [s for s in sent_sessions if s not in sessions]
            now = loop.time()
            if (
                sent_backends is None
                or view != sent_backends
                or added
                or removed
                or now - last_sent > FEED_HEARTBEAT_SECONDS
            ):
                yield router_pb2.WatchBackendsResponse(
                    backends=backends,
                    placement=placement.name,
                    epsilon=epsilon if math.isfinite(epsilon) else 0.0,
                    complete=sent_backends is None,
                    sessions_added=added,
                    sessions_removed=removed,
                )
                sent_sessions, sent_backends, last_sent = sessions, view, now
            await asyncio.sleep(FEED_INTERVAL_SECONDS)
