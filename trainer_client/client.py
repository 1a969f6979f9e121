"""``InferenceClient``: what a trainer uses to generate and to control the fleet (asyncio API).

A client owns one ``ClientCore`` (its config, connections and call helpers) and four parts,
each a plain class handed that core: ``generation`` (data-plane calls: to the server the
router's policy picks, directly or through the router; ``x-session-id`` keeps a conversation
on one server), ``fleet`` (control calls fanned out to every server directly and
concurrently), ``adapters`` (LoRA) and ``weights`` (updates as fleet-wide transactions, and
the weight path's process-local state). The client's own methods are the parts' methods,
forwarded (``forward``), so ``client.update_weights`` is ``client.weights.update_weights``.

What a client pickles is its ``ClientConfig`` alone; what it holds besides is process-local
and rebuilt on the other side: channels and the routing view, opened lazily per event loop
(``connections``), and the weight-transfer state (the collective group's rank 0, the last
pushed weights for deltas). So a client can be handed to Ray actors and subprocesses as is.
``BlockingInferenceClient`` (``trainer_client.blocking``) offers the same methods without
``await``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar, Unpack, cast

from trainer_client.client_core import ClientCore
from trainer_client.config import ClientConfig, ClientSettings
from trainer_client.connections import Connections
from trainer_client.fleet_control import FleetControl
from trainer_client.generation import Generation
from trainer_client.lora import Adapters
from trainer_client.weights.weight_updates import WeightUpdates

P = ParamSpec("P")
R = TypeVar("R")


def forward(
    part: str, method: Callable[Concatenate[Any, P], R]
) -> Callable[Concatenate[Any, P], R]:
    """A client method that calls ``method`` on the client's ``part`` (an attribute's name):
    the same name, signature, docstring and kind (a coroutine function, or an async generator
    function), so ``help()``, ``inspect`` and type checkers see the part's method."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):

        async def stream(self: Any, /, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
            chunks = getattr(getattr(self, part), name)(*args, **kwargs)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk

        wrapper: Callable[..., Any] = stream
    elif inspect.iscoroutinefunction(method):

        async def call(self: Any, /, *args: Any, **kwargs: Any) -> Any:
            return await getattr(getattr(self, part), name)(*args, **kwargs)

        wrapper = call
    else:

        def plain(self: Any, /, *args: Any, **kwargs: Any) -> Any:
            return getattr(getattr(self, part), name)(*args, **kwargs)

        wrapper = plain
    return cast(Callable[Concatenate[Any, P], R], functools.wraps(method)(wrapper))


class InferenceClient:
    """Asyncio client of a skyrl-grpc fleet: ``router``, the router's address; ``servers``,
    the engine servers' (for control calls); ``settings``, any ``ClientConfig`` field
    (``token``, ``tls``, ``direct``, timeouts, ...)."""

    config: ClientConfig
    generation: Generation
    fleet: FleetControl
    adapters: Adapters
    weights: WeightUpdates

    def __init__(
        self, router: str, servers: Sequence[str] = (), **settings: Unpack[ClientSettings]
    ) -> None:
        self._setup(ClientConfig(router=router, servers=tuple(servers), **settings))

    @classmethod
    def from_config(cls, config: ClientConfig) -> InferenceClient:
        client = cls.__new__(cls)
        client._setup(config)
        return client

    def _setup(self, config: ClientConfig) -> None:
        """The one place a client's fields are set (constructor, from_config, unpickling)."""
        self.config = config
        self._core = ClientCore(config)
        self.generation = Generation(self._core)
        self.fleet = FleetControl(self._core)
        self.adapters = Adapters(self._core)
        self.weights = WeightUpdates(self._core)

    # Pickle the config only: channels belong to one process and event loop.
    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["config"])

    @property
    def connections(self) -> Connections:
        """This client's per-event-loop resources (channels; other per-loop objects through
        ``connections.loop_local``), closed with their loop."""
        return self._core.connections

    async def close(self) -> None:
        """Closes what this event loop opened (channels, the routing feed). Also done when
        the loop ends under ``asyncio.run``."""
        await self._core.close()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def last_push_bytes(self) -> dict[str, int]:
        """Bytes of parameter data each server received in the last update."""
        return self.weights.last_push_bytes

    @property
    def last_sent_bytes(self) -> int:
        """Bytes this client itself sent in the last in-band update (relayed: each stream
        once, whatever the fleet's size)."""
        return self.weights.last_sent_bytes

    @property
    def cut_out_servers(self) -> dict[str, str]:
        """The servers cut out of control calls and updates now (``cut_out_unreachable``),
        each with why: each is asked again by the next pause, resume or update once
        ``trainer_client.cut_out.ASK_AGAIN_SECONDS`` passed, and taken back once it answers
        (an update then sends it the whole weights). A run that must end with every server on
        its last weights steps on until this is empty and an update committed with no
        ``WeightUpdateResult.cut_out``: a server taken back by a pause or a resume has the
        updates it missed only once the next update sends it the whole weights."""
        return dict(self._core.cut_out)

    @property
    def has_weight_group(self) -> bool:
        """True once ``init_weight_transfer`` formed the collective group."""
        return self.weights.has_weight_group

    # -- data plane: generations, tokenizer, sessions (``generation``) ------------------------
    stream = forward("generation", Generation.stream)
    generate = forward("generation", Generation.generate)
    generate_batch = forward("generation", Generation.generate_batch)
    sample = forward("generation", Generation.sample)
    chat = forward("generation", Generation.chat)
    complete = forward("generation", Generation.complete)
    tokenize = forward("generation", Generation.tokenize)
    detokenize = forward("generation", Generation.detokenize)
    model_info = forward("generation", Generation.model_info)
    finish_session = forward("generation", Generation.finish_session)

    # -- control plane, every server at once (``fleet``) --------------------------------------
    pause = forward("fleet", FleetControl.pause)
    resume = forward("fleet", FleetControl.resume)
    is_paused = forward("fleet", FleetControl.is_paused)
    all_paused = forward("fleet", FleetControl.all_paused)
    sleep = forward("fleet", FleetControl.sleep)
    wake_up = forward("fleet", FleetControl.wake_up)
    is_sleeping = forward("fleet", FleetControl.is_sleeping)
    reset_prefix_cache = forward("fleet", FleetControl.reset_prefix_cache)
    server_info = forward("fleet", FleetControl.server_info)
    server_loads = forward("fleet", FleetControl.server_loads)
    world_size = forward("fleet", FleetControl.world_size)

    # -- LoRA adapters (``adapters``) ----------------------------------------------------------
    load_lora = forward("adapters", Adapters.load_lora)
    unload_lora = forward("adapters", Adapters.unload_lora)
    list_loras = forward("adapters", Adapters.list_loras)

    # -- weights (``weights``) -----------------------------------------------------------------
    init_weight_transfer = forward("weights", WeightUpdates.init_weight_transfer)
    update_weights = forward("weights", WeightUpdates.update_weights)
    reserve_delta_base = forward("weights", WeightUpdates.reserve_delta_base)
    cancel_weight_update = forward("weights", WeightUpdates.cancel_weight_update)
    rollback_weights = forward("weights", WeightUpdates.rollback_weights)
    weight_checksums = forward("weights", WeightUpdates.weight_checksums)
    weight_versions = forward("weights", WeightUpdates.weight_versions)
