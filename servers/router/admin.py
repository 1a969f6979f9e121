"""RouterAdmin servicer: backend membership at runtime, over the BackendPool, and the routing
view clients follow to route data-plane calls themselves (WatchBackends)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from servers.common.addresses import host_port
from servers.common.grpc_types import Context
from servers.router.backends import BackendPool
from servers.router.feed import RoutingFeed
from servers.router.siblings import Siblings, passed_on
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc


class RouterAdminServicer(router_pb2_grpc.RouterAdminServicer):
    """``siblings``: the router's other replicas, told every membership change this one is
    (None: the only router on its port)."""

    def __init__(self, pool: BackendPool, siblings: Siblings | None = None) -> None:
        self._pool = pool
        self._siblings = siblings
        self._feed = RoutingFeed(pool.describe, pool.placement)

    async def _pass_on(self, call: str, request: object, context: Context) -> None:
        if self._siblings is not None and not passed_on(context.invocation_metadata()):
            await self._siblings.tell(call, request)

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
        backend = self._pool.add(host_port(request.address), standby=request.standby)
        await self._pass_on("AddBackend", request, context)
        return router_pb2.AddBackendResponse(backend=self._pool.describe([backend])[0])

    async def RemoveBackend(
        self,
        request: router_pb2.RemoveBackendRequest,
        context: Context,
    ) -> router_pb2.RemoveBackendResponse:
        await self._pool.remove(request.address)
        await self._pass_on("RemoveBackend", request, context)
        return router_pb2.RemoveBackendResponse()

    async def SetStandby(
        self,
        request: router_pb2.SetStandbyRequest,
        context: Context,
    ) -> router_pb2.SetStandbyResponse:
        backend = self._pool.set_standby(request.address, request.standby)
        await self._pass_on("SetStandby", request, context)
        return router_pb2.SetStandbyResponse(backend=self._pool.describe([backend])[0])

    async def DrainBackend(
        self,
        request: router_pb2.DrainBackendRequest,
        context: Context,
    ) -> router_pb2.DrainBackendResponse:
        passing_on = asyncio.ensure_future(self._pass_on("DrainBackend", request, context))
        remaining = await self._pool.drain(request.address, context.time_remaining())
        await passing_on
        return router_pb2.DrainBackendResponse(remaining_in_flight=remaining)

    async def WatchBackends(
        self,
        request: router_pb2.WatchBackendsRequest,
        context: Context,
    ) -> AsyncIterator[router_pb2.WatchBackendsResponse]:
        async for update in self._feed.watch():
            yield update
