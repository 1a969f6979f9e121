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
from trainer_client.cut_out import CutOff, CutOutServers, rejoining, unless_cut_off
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
        # Servers cut out of the fleet's calls, unreachable then, with why (``cut_out``).
        self.cut_out = CutOutServers()

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
        asked over a fresh channel that later calls then use (``Connections.reopen``): for a
        server cut out, whose old channel may still wait out a connection attempt."""
        self.connections.reopen(address)
        return await self._answers(address, self.control(address), seconds)

    async def answers_aside(self, address: str, seconds: float) -> bool:
        """``answers``, over a channel of its own, closed after: the calls under way on the
        client's channel go on undisturbed."""
        async with self.config.open_channel(address) as channel:
            stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
            return await self._answers(address, stub, seconds)

    async def _answers(self, address: str, stub: ControlStub, seconds: float) -> bool:
        request = cp.GetServerInfoRequest()
        try:
            await self.unary(address, stub.GetServerInfo, request, seconds, plane="control")
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
        *,
        cut_out: bool = False,
        among: Sequence[str] | None = None,
    ) -> dict[str, T]:
        """``rpc`` on every server at once; what ``read`` takes from each server's answer, or
        ``FanOutError`` (whose ``results`` hold the same for the servers that answered).
        ``wait_for_starting``: seconds to wait first for servers up but still starting
        (``readiness``), so the call reaches them once they serve instead of failing there.
        ``cut_out``: a server that cannot be reached is cut out instead of failing the call,
        and one cut out earlier is left out unless it answers now (``trainer_client.cut_out``);
        neither is in the result. ``among``: these servers instead of the fleet's."""
        deadline = self.deadline("control", timeout)

        async def call(address: str) -> T:
            stub_call = rpc(self.control(address))
            return read(await self.unary(address, stub_call, request, deadline, plane="control"))

        operation = type(request).__name__.removesuffix("Request")
        servers = list(among) if among is not None else await self.control_servers()
        if not cut_out:
            await wait_while_starting(self.channel, servers, wait_for_starting)
            return await fan_out(operation, servers, call)
        servers, _ = await rejoining(self.cut_out, servers, self.answers, self.connections.spawn)

        async def once_started(address: str) -> T:
            await wait_while_starting(self.channel, [address], wait_for_starting)
            return await call(address)

        async def call_unless_cut_off(address: str) -> T | CutOff:
            # The wait for a starting server too: one cut off would hold it for its health
            # check's deadline.
            started_call = once_started(address)
            return await unless_cut_off(address, started_call, self.answers_aside, self.cut_out)

        results = await fan_out(operation, servers, call_unless_cut_off)
        return {a: r for a, r in results.items() if not isinstance(r, CutOff)}

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
