"""What every part of the client stands on: its config, its connections, and one way to make
a call (``unary``) and to make it on every server (``fan_out``, typed by the stub method).

The parts (``generation.Generation``, ``fleet_control.FleetControl``, ``lora.Adapters``,
``weights.weight_updates.WeightUpdates``) are each handed one ``ClientCore``;
``trainer_client.client.InferenceClient`` owns them and the core.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias, TypeVar

import grpc
from google.protobuf.message import Message as ProtoMessage

from skyrl_grpc import tracing
from skyrl_grpc.metadata import SESSION_ID
from skyrl_grpc.session_moves import finish_moved_session
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc, data_plane_pb2_grpc
from trainer_client.config import DEFAULT, ClientConfig, Plane, Timeout
from trainer_client.connections import Connections
from trainer_client.exceptions import InferenceError, ServerError
from trainer_client.fanout import fan_out
from trainer_client.readiness import wait_while_starting

T = TypeVar("T")
Request = TypeVar("Request", bound=ProtoMessage)
Response = TypeVar("Response", bound=ProtoMessage)
# Type-checking names only (the async stub exists in the .pyi, not at runtime).
ControlStub: TypeAlias = "control_plane_pb2_grpc.ControlPlaneAsyncStub"
DataStub: TypeAlias = "data_plane_pb2_grpc.DataPlaneAsyncStub"
# Picks one RPC of the control plane's stub, e.g. ``lambda stub: stub.Pause``.
ControlRpc: TypeAlias = (
    "Callable[[ControlStub], grpc.aio.UnaryUnaryMultiCallable[Request, Response]]"
)


class ClientCore:
    """A client's config, its connections and the call helpers every part uses. Made per
    process: a client pickles its config alone and makes a new core when unpickled."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        if config.otlp_traces_endpoint and not tracing.enabled():
            tracing.configure("skyrl-trainer-client", config.otlp_traces_endpoint)
        # Channels, the routing view and background calls, per event loop (never pickled).
        self.connections = Connections(config, self._session_moved)

    def channel(self, address: str) -> grpc.aio.Channel:
        return self.connections.channel(address)

    async def close(self) -> None:
        await self.connections.close()

    def deadline(self, plane: Plane, timeout: Timeout) -> float | None:
        """Seconds a call to ``plane`` may take (None: no deadline); see ``config.DEFAULT``."""
        return self.config.timeout(plane, timeout)

    def metadata(self, plane: Plane, session_id: str | None = None) -> tuple[tuple[str, str], ...]:
        metadata = self.config.metadata(plane)
        return (*metadata, (SESSION_ID, session_id)) if session_id else metadata

    def _session_moved(self, address: str, session_id: str) -> None:
        """Direct routing moved ``session_id`` away from ``address``: tell it (best effort)."""
        self.connections.spawn(
            finish_moved_session(
                self.channel(address), session_id, timeout=5, metadata=self.config.metadata("data")
            )
        )

    def data(self, address: str | None = None) -> DataStub:
        """The DataPlane of the server at ``address`` (its generation channel:
        ``Connections.data_channel``), or None: the router's."""
        if address is None:
            return data_plane_pb2_grpc.DataPlaneStub(self.channel(self.config.router))
        return data_plane_pb2_grpc.DataPlaneStub(self.connections.data_channel(address))

    def control(self, address: str) -> ControlStub:
        return control_plane_pb2_grpc.ControlPlaneStub(self.channel(address))

    async def unary(
        self,
        address: str,
        call: Callable[..., Awaitable[T]],
        request: Any,
        timeout: float | None,
        session_id: str | None = None,
        *,
        plane: Plane,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> T:
        """One call to ``plane`` with a deadline of ``timeout`` seconds (None: none) and
        ``metadata`` beside the client's own; a failure raises ``ServerError`` (as its
        status's subclass)."""
        sent = self.metadata(plane, session_id)
        if metadata:
            sent = (*sent, *metadata)
        try:
            return await call(request, timeout=timeout, metadata=sent)
        except grpc.aio.AioRpcError as error:
            raise ServerError.from_rpc_error(address, error) from error

    async def answers(self, address: str, seconds: float) -> bool:
        """Whether ``address``'s control plane answers (``GetServerInfo``) within ``seconds``,
        asked over a fresh channel (``Connections.reopen``): for a server that could not be
        reached before, whose old channel may still wait out a connection attempt."""
        self.connections.reopen(address)
        try:
            await self.unary(
                address,
                self.control(address).GetServerInfo,
                cp.GetServerInfoRequest(),
                seconds,
                plane="control",
            )
        except InferenceError:
            return False
        return True

    async def fan_out(
        self,
        rpc: ControlRpc[Request, Response],
        request: Request,
        timeout: Timeout,
        read: Callable[[Response], T],
        wait_for_starting: float = 0.0,
    ) -> dict[str, T]:
        """``rpc`` on every server at once; what ``read`` takes from each server's answer, or
        ``FanOutError`` (whose ``results`` hold the same for the servers that answered).
        ``wait_for_starting``: seconds to wait first for servers up but still starting
        (``readiness``), so the call reaches them once they serve instead of failing there."""
        deadline = self.deadline("control", timeout)

        async def call(address: str) -> T:
            stub_call = rpc(self.control(address))
            return read(await self.unary(address, stub_call, request, deadline, plane="control"))

        operation = type(request).__name__.removesuffix("Request")
        servers = await self.control_servers()
        await wait_while_starting(self.channel, servers, wait_for_starting)
        return await fan_out(operation, servers, call)

    async def control_servers(self) -> list[str]:
        """The servers control calls reach: the fleet as the router sees it now, when this
        client routes itself and was given the router's whole fleet (so a server that moved,
        or one added or removed since, is reached without rebuilding the client); else the
        servers it was given."""
        given = list(self.config.servers)
        if not self.config.direct or not given:
            return given
        routes = self.connections.routes()
        if not await routes.ready():
            return given
        return await routes.fleet_now(given) or given


__all__ = ["DEFAULT", "ClientCore", "ControlRpc", "Request", "Response", "Timeout"]
