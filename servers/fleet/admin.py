"""FleetAdmin: the running fleet's Scale verb over gRPC, for a trainer or an operator that is
not ``up``'s terminal (``skyrl-grpc up --admin-port``; ``skyrl-grpc scale``;
``trainer_client.FleetAdminClient``).

The servicer is thin: one plain class (``FleetScaler``) holds the rule (one Scale at a time, at
least one server) over two callables, the fleet's ``scale`` and its addresses; the servicer
converts messages and statuses. It runs on a thread pool of its own beside ``up``'s loop, since
a Scale blocks for as long as servers take to start.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from servers.fleet import FleetAddresses
from skyrl_grpc.v1 import fleet_admin_pb2, fleet_admin_pb2_grpc

log = logging.getLogger(__name__)


class ScaleRefused(Exception):
    """A Scale that cannot run: ``code`` is the gRPC status it answers with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class FleetScaler:
    """Runs ``scale(count)`` one call at a time; ``addresses()`` is the fleet now."""

    def __init__(
        self,
        scale: Callable[[int], FleetAddresses],
        addresses: Callable[[], FleetAddresses],
    ) -> None:
        self._scale = scale
        self.addresses = addresses
        self._running = threading.Lock()

    def scale(self, count: int) -> FleetAddresses:
        if count < 1:
            raise ScaleRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"servers={count}: a fleet keeps at least one serving server",
            )
        if not self._running.acquire(blocking=False):
            raise ScaleRefused(
                grpc.StatusCode.ABORTED,
                "another Scale is running: wait for it to end, then scale again",
            )
        try:
            return self._scale(count)
        except Exception as error:  # the servers that started stay members
            log.warning("scale to %d failed: %s", count, error)
            raise ScaleRefused(
                grpc.StatusCode.UNAVAILABLE,
                f"scale to {count} failed: {error}; the fleet is now "
                f"{len(self.addresses().servers)} servers (ListMembers)",
            ) from error
        finally:
            self._running.release()


def members(addresses: FleetAddresses) -> fleet_admin_pb2.FleetMembers:
    return fleet_admin_pb2.FleetMembers(
        router=addresses.router, servers=addresses.servers, standbys=addresses.standbys
    )


class FleetAdminServicer(fleet_admin_pb2_grpc.FleetAdminServicer):
    """FleetAdmin over a ``FleetScaler``; with ``token``, every call must carry it."""

    def __init__(self, scaler: FleetScaler, token: str | None = None) -> None:
        self._scaler = scaler
        self._token = token

    def _authorize(self, context: grpc.ServicerContext) -> None:
        if self._token is None:
            return
        sent = dict(context.invocation_metadata()).get("authorization", "")
        if not hmac.compare_digest(str(sent), f"Bearer {self._token}"):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token for FleetAdmin: send metadata "
                "'authorization: Bearer <token>' with the fleet's --admin-token",
            )

    def Scale(
        self, request: fleet_admin_pb2.ScaleRequest, context: grpc.ServicerContext
    ) -> fleet_admin_pb2.ScaleResponse:
        self._authorize(context)
        try:
            addresses = self._scaler.scale(request.servers)
        except ScaleRefused as refused:
            context.abort(refused.code, str(refused))
        return fleet_admin_pb2.ScaleResponse(members=members(addresses))

    def ListMembers(
        self, request: fleet_admin_pb2.ListMembersRequest, context: grpc.ServicerContext
    ) -> fleet_admin_pb2.ListMembersResponse:
        self._authorize(context)
        return fleet_admin_pb2.ListMembersResponse(members=members(self._scaler.addresses()))


def serve(scaler: FleetScaler, host: str, port: int, token: str | None = None) -> tuple[Any, int]:
    """FleetAdmin on ``host:port`` (0: a free port), started; the server and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="admin"))
    fleet_admin_pb2_grpc.add_FleetAdminServicer_to_server(FleetAdminServicer(scaler, token), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"FleetAdmin cannot listen on {host}:{port}")
    server.start()
    return server, bound
