"""RouterAdmin servicer: backend membership at runtime, over the BackendPool, and the routing
view clients follow to route data-plane calls themselves (WatchBackends)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from servers.common.addresses import host_port
from servers.common.grpc_types import Context
from servers.router.backends import BackendPool
from servers.router.feed import RoutingFeed
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc


class RouterAdminServicer(router_pb2_grpc.RouterAdminServicer):
    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool
        self._feed = RoutingFeed(pool.describe, pool.placement)

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
        async for update in self._feed.watch():
            yield update
