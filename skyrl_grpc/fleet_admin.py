"""A client of FleetAdmin (``skyrl-grpc up --admin-port``): grows or shrinks a running fleet
from a trainer's code (``trainer_client.FleetAdminClient``) or the command line
(``skyrl-grpc scale``). Blocking: a Scale takes as long as its servers take to start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from skyrl_grpc.v1 import fleet_admin_pb2, fleet_admin_pb2_grpc


class FleetAdminError(RuntimeError):
    """A FleetAdmin call failed: ``code`` is its gRPC status, the message says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


@dataclass(frozen=True)
class FleetMembers:
    """A fleet's router and servers (its warm standbys among them)."""

    router: str
    servers: tuple[str, ...]
    standbys: tuple[str, ...]

    @property
    def serving(self) -> tuple[str, ...]:
        """The servers that take calls (not standbys)."""
        return tuple(s for s in self.servers if s not in self.standbys)


def _members(message: fleet_admin_pb2.FleetMembers) -> FleetMembers:
    return FleetMembers(message.router, tuple(message.servers), tuple(message.standbys))


class FleetAdminClient:
    """FleetAdmin on ``address`` (host:port); ``token``: the fleet's --admin-token."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = fleet_admin_pb2_grpc.FleetAdminStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def scale(self, servers: int, timeout: float = 900.0) -> FleetMembers:
        """Grows or shrinks the fleet to ``servers`` serving servers (standbys kept); returns
        the members once added servers serve and removed ones are drained and stopped."""
        request = fleet_admin_pb2.ScaleRequest(servers=servers)
        return self._call(self._stub.Scale, request, timeout)

    def members(self, timeout: float = 30.0) -> FleetMembers:
        """The fleet's members now."""
        return self._call(self._stub.ListMembers, fleet_admin_pb2.ListMembersRequest(), timeout)

    def _call(self, method: Any, request: Any, timeout: float) -> FleetMembers:
        """``method(request)``; its members, or FleetAdminError naming the status."""
        try:
            response = method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise FleetAdminError(error.code(), error.details() or "") from None
        return _members(response.members)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> FleetAdminClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
