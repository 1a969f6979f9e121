"""``InferenceClient``: what a trainer uses to generate and to control the fleet (asyncio API).

Data-plane calls (``generation``) go to the server the router's policy picks, directly or
through the router (``x-session-id`` keeps a conversation on one server); control calls
(``fleet_control``, ``lora``, ``weights.weight_updates``) fan out to every server directly and
concurrently. What a client pickles is its ``ClientConfig`` alone; what it holds besides is
process-local and rebuilt on the other side: channels and the routing view, opened lazily per
event loop (``connections``), and the weight-transfer state (the collective group's rank 0,
the last pushed weights for deltas, ``weight_updates``). So a client can be handed to Ray
actors and subprocesses as is. ``BlockingInferenceClient`` (``trainer_client.blocking``)
offers the same methods without ``await``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Unpack

from trainer_client.config import ClientConfig, ClientSettings
from trainer_client.fleet_control import FleetControl
from trainer_client.generation import Generation
from trainer_client.lora import Adapters
from trainer_client.weights.weight_updates import WeightUpdates


class InferenceClient(Generation, FleetControl, Adapters, WeightUpdates):
    """Asyncio client of a skyrl-grpc fleet: ``router``, the router's address; ``servers``,
    the engine servers' (for control calls); ``settings``, any ``ClientConfig`` field
    (``token``, ``tls``, ``direct``, timeouts, ...)."""

    def __init__(
        self, router: str, servers: Sequence[str] = (), **settings: Unpack[ClientSettings]
    ) -> None:
        self._setup(ClientConfig(router=router, servers=tuple(servers), **settings))

    @classmethod
    def from_config(cls, config: ClientConfig) -> InferenceClient:
        client = cls.__new__(cls)
        client._setup(config)
        return client

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
