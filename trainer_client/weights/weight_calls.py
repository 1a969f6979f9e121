"""The per-server control calls of a fleet weight update (start, finish, cancel, rollback,
release, the serving version), over the client's channels, as ``weight_transaction`` runs them."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Sequence

from skyrl_grpc.v1 import control_plane_pb2 as cp
from trainer_client.client_core import ClientCore, ControlRpc, Request, Response
from trainer_client.config import DEFAULT
from trainer_client.fleet_info import WeightCommit
from trainer_client.weights.push_lanes import PushSocketOffer
from trainer_client.weights.relay_plan import RelayPlan
from trainer_client.weights.update_plan import ServerState


def owner_name() -> str:
    """How this process names itself to the servers (in weight-update leases)."""
    return f"trainer@{socket.gethostname()}:{os.getpid()}"


class ServerWeightCalls:
    """The per-server calls of a fleet weight update, over the client's channels: what
    ``weight_transaction.TransactionCalls`` asks for, and the state and push sockets the
    update plan reads."""

    def __init__(
        self, client: ClientCore, lease_seconds: int, cleanup_seconds: float | None = None
    ) -> None:
        self._client = client
        self._lease_seconds = lease_seconds
        # The deadline of a failed update's cancel and version question (None: the client's
        # control timeout): short where a server that does not answer is cut out, not waited.
        self._cleanup_seconds = cleanup_seconds
        self._owner = owner_name()
        # Each server's state as first asked in this update (``state``).
        self._states: dict[str, ServerState] = {}
        # The push sockets the servers offered for this update (``start``).
        self.push_sockets: dict[str, PushSocketOffer] = {}
        # Who relays the update to whom (None: the trainer streams to every server).
        self.relay: RelayPlan | None = None

    async def start(self, address: str, version: int) -> int:
        request = cp.StartWeightUpdateRequest(
            weight_version=version, owner=self._owner, lease_seconds=self._lease_seconds
        )
        relay = self.relay
        if relay is not None and relay.relays(address):
            request.push_ticket = relay.tickets[address]
            request.relay.CopyFrom(self._role(relay, address))
        response = await self._call(address, request, lambda s: s.StartWeightUpdate)
        if response.push_socket_port and self._sockets_allowed:
            self.push_sockets[address] = PushSocketOffer(
                response.push_socket_port, response.push_ticket
            )
        return response.serving_weight_version

    @property
    def _sockets_allowed(self) -> bool:
        config = self._client.config
        return config.push_socket and config.tls is None

    def _role(self, relay: RelayPlan, address: str) -> cp.WeightRelayRole:
        """``address``'s place in each relay tree of its group: its parent, and each child with
        its ticket and the push socket the relay reaches it on (none with TLS, or where this
        client pushes over gRPC: the servers relay as the trainer would send)."""

        def port(child: str) -> int:
            known = self._states.get(child)
            return known.push_socket_port if known is not None and self._sockets_allowed else 0

        return cp.WeightRelayRole(
            address=address,
            trees=[
                cp.WeightRelayTree(
                    parent=tree.parents[address],
                    children=[
                        cp.WeightRelayTarget(
                            address=child,
                            push_socket_port=port(child),
                            push_ticket=relay.tickets[child],
                        )
                        for child in tree.children.get(address, ())
                    ],
                )
                for tree in relay.trees_of(address)
            ],
        )

    async def finish(self, address: str, version: int) -> WeightCommit:
        request = cp.FinishWeightUpdateRequest(weight_version=version)
        response = await self._call(address, request, lambda s: s.FinishWeightUpdate)
        return WeightCommit.from_proto(response)

    async def cancel(self, address: str) -> None:
        request = cp.CancelWeightUpdateRequest()
        await self._call(address, request, lambda s: s.CancelWeightUpdate, self._cleanup_seconds)

    async def rollback(self, address: str, version: int) -> int:
        request = cp.RollbackWeightUpdateRequest(weight_version=version)
        response = await self._call(address, request, lambda s: s.RollbackWeightUpdate)
        return response.weight_version

    async def release(self, address: str, version: int) -> None:
        request = cp.ReleaseRollbackRequest(weight_version=version)
        await self._call(address, request, lambda s: s.ReleaseRollback)

    async def serving_version(self, address: str) -> int:
        """The version ``address`` serves now (asked again: the transaction reports it)."""
        return (await self._ask(address, self._cleanup_seconds)).version

    async def state(self, address: str) -> ServerState:
        """What the update needs of a server before it starts (its version, whether it takes
        compressed patches, its collective group), asked once per update: the group check and
        the plan share the answer."""
        known = self._states.get(address)
        if known is None:
            known = self._states[address] = await self._ask(address)
        return known

    def one_stream(self, address: str) -> bool:
        """Whether ``address`` takes an update's groups as one stream of several manifests (it
        said so before the update: ``Capabilities.weight_relay_trees``)."""
        known = self._states.get(address)
        return known is not None and known.relays

    async def known_states(self, addresses: Sequence[str]) -> dict[str, ServerState]:
        """The state of each of ``addresses`` that answers (``state``)."""
        answers = await asyncio.gather(*(self.state(a) for a in addresses), return_exceptions=True)
        return {a: s for a, s in zip(addresses, answers, strict=True) if isinstance(s, ServerState)}

    async def reachable(self, servers: Sequence[str]) -> tuple[list[str], dict[str, str]]:
        """Of ``servers``, the ones that answer now and the ones cut out, with why: each is
        asked its state (``ClientCore.fan_out`` with ``cut_out``: one cut out earlier is asked
        again when due, one whose answer takes longer than a probe's wait is probed aside and
        cut out if silent), which ``state`` then answers from. None answering: all of them,
        for the update to fail naming each."""
        client = self._client
        answered = await client.fan_out(
            lambda s: s.GetServerInfo,
            cp.GetServerInfoRequest(),
            DEFAULT,
            _state_of,
            cut_out=True,
            among=servers,
        )
        self._states.update(answered)
        cut_out = client.cut_out
        out = {a: cut_out[a] for a in servers if a in cut_out and a not in answered}
        return [a for a in servers if a in answered] or list(servers), out

    async def _ask(self, address: str, seconds: float | None = None) -> ServerState:
        request = cp.GetServerInfoRequest()
        return _state_of(await self._call(address, request, lambda s: s.GetServerInfo, seconds))

    async def _call(
        self,
        address: str,
        request: Request,
        rpc: ControlRpc[Request, Response],
        seconds: float | None = None,
    ) -> Response:
        """``rpc`` on ``address`` within ``seconds`` (None: the client's control timeout)."""
        client = self._client
        stub_method = rpc(client.control(address))
        timeout = client.config.control_timeout if seconds is None else seconds
        return await client.unary(address, stub_method, request, timeout, plane="control")


def _state_of(info: cp.GetServerInfoResponse) -> ServerState:
    """What an update needs of a server, from its ``GetServerInfo`` answer."""
    group = info.weight_transfer_group
    return ServerState(
        info.weight_version,
        info.capabilities.compressed_weight_patches,
        (group.master_address, group.master_port)
        if info.HasField("weight_transfer_group")
        else None,
        relays=info.capabilities.weight_relay_trees,
        push_socket_port=info.push_socket_port,
    )
