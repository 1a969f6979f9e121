"""A client's connections, per process and event loop: channels, the routing view, background calls.

A ``grpc.aio`` channel belongs to the event loop it was opened on, and a client is used from
several (a blocking client's private loop, each ``asyncio.run`` of a trainer that calls it once
per step, each Ray actor after unpickling). ``Connections`` keeps one ``LoopResources`` per loop
and ends it with its loop: a watcher task on the loop is cancelled when ``asyncio.run`` ends
(asyncio cancels every task still pending then, and lets them finish), and closes the loop's
channels and routing feed while the loop still runs. Resources of a loop that was closed without
that (``loop.close()`` by hand) are dropped the next time any loop asks, and grpc closes a
dropped channel itself. After a fork, the parent's resources are not the child's: the child
starts with none.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc

from skyrl_grpc.multiplex import Multiplexers
from trainer_client.config import ClientConfig
from trainer_client.direct import DirectRoutes

log = logging.getLogger(__name__)
T = TypeVar("T")
# How long the calls of a channel dropped by ``reopen`` may go on.
REOPEN_GRACE_SECONDS = 5.0


class LoopResources:
    """One event loop's channels (one per address), routing view and background calls."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.channels: dict[str, grpc.aio.Channel] = {}
        # Channels of generations sent straight to a server (``Connections.data_channel``).
        self.data_channels: dict[str, grpc.aio.Channel] = {}
        # The streams of direct generations, one GenerateMultiplex call per server.
        self.multiplexers = Multiplexers()
        self.routes: DirectRoutes | None = None
        self.background: set[asyncio.Task[Any]] = set()
        self.watcher: asyncio.Task[None] | None = None
        # Other per-loop objects (e.g. an HTTP client), each with the coroutine that closes it.
        self.extras: dict[str, tuple[Any, Callable[[], Awaitable[None]]]] = {}

    async def close(self) -> None:
        """Cancels the background calls, stops the routing feed, closes the channels."""
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        if self.routes is not None:
            await self.routes.close()
            self.routes = None
        await self.multiplexers.close()
        channels = [*self.channels.values(), *self.data_channels.values()]
        self.channels, self.data_channels = {}, {}
        for channel in channels:
            await channel.close()
        extras, self.extras = list(self.extras.values()), {}
        for _, close in extras:
            await close()


class Connections:
    """Per-loop resources of one client; see the module docstring. Holds nothing that pickles:
    the client rebuilds it after unpickling."""

    def __init__(
        self, config: ClientConfig, on_session_moved: Callable[[str, str], None] | None = None
    ) -> None:
        self._config = config
        # Direct routing: called with (server the session left, session) when it moves.
        self._on_session_moved = on_session_moved or (lambda address, session: None)
        self._pid = os.getpid()
        self._loops: dict[asyncio.AbstractEventLoop, LoopResources] = {}

    def _resources(self) -> LoopResources:
        loop = asyncio.get_running_loop()
        if self._pid != os.getpid():  # a forked child: its parent's loops are not its own
            self._pid, self._loops = os.getpid(), {}
        resources = self._loops.get(loop)
        if resources is None:
            self._drop_closed_loops()
            resources = self._loops[loop] = LoopResources(loop)
            resources.watcher = loop.create_task(self._end_with_loop(resources))
        return resources

    def _drop_closed_loops(self) -> None:
        for loop in [loop for loop in self._loops if loop.is_closed()]:
            del self._loops[loop]  # grpc closes a channel it drops (Channel.__del__)

    async def _end_with_loop(self, resources: LoopResources) -> None:
        try:
            await asyncio.get_running_loop().create_future()  # until cancelled
        except GeneratorExit:
            # The loop was dropped without running this task to its end: nothing can be
            # awaited any more (grpc closes the channels it drops itself).
            self._forget(resources)
            raise
        except BaseException:
            # Cancelled by close(), or by asyncio.run ending its loop: the loop still runs
            # here, so the channels close cleanly.
            self._forget(resources)
            await resources.close()
            raise

    def _forget(self, resources: LoopResources) -> None:
        if self._loops.get(resources.loop) is resources:
            del self._loops[resources.loop]

    @property
    def open_loops(self) -> int:
        """How many event loops hold resources (for tests and leak checks)."""
        return len(self._loops)

    def channel(self, address: str) -> grpc.aio.Channel:
        """The running loop's channel to ``address``, opened on first use."""
        resources = self._resources()
        channel = resources.channels.get(address)
        if channel is None:
            channel = resources.channels[address] = self._config.open_channel(address)
        return channel

    def data_channel(self, address: str) -> grpc.aio.Channel:
        """The running loop's channel for generations sent straight to the server at
        ``address``: apart from the control channel, with the liveness of
        ``direct_liveness_seconds``, so a stream on a host cut off fails then and moves on."""
        resources = self._resources()
        channel = resources.data_channels.get(address)
        if channel is None:
            channel = self._config.open_channel(address, self._config.direct_liveness_seconds)
            resources.data_channels[address] = channel
        return channel

    def multiplexers(self) -> Multiplexers:
        """The running loop's multiplexed calls (``ClientConfig.multiplex``)."""
        return self._resources().multiplexers

    def reopen(self, address: str) -> None:
        """Drops the running loop's channel to ``address``: the next call opens a fresh one,
        which connects at once. A channel whose connection attempt began while the server was
        cut off waits out that attempt (gRPC's 20 s) after the heal. The old channel closes in
        the background, its calls given ``REOPEN_GRACE_SECONDS`` to end."""
        resources = self._resources()
        resources.multiplexers.retire(address)  # its requests end on the old channel
        for channels in (resources.channels, resources.data_channels):
            old = channels.pop(address, None)
            if old is not None:
                self.spawn(old.close(grace=REOPEN_GRACE_SECONDS))

    def routes(self) -> DirectRoutes:
        """The running loop's view of the router's routing (direct routing)."""
        resources = self._resources()
        if resources.routes is None:
            resources.routes = DirectRoutes(
                self.channel(self._config.router),
                self._config.metadata("data"),  # the router's view: its open methods
                self._on_session_moved,
                servers=self._config.servers,
                server_channel=self.channel,
            )
        return resources.routes

    def loop_local(
        self, key: str, open_: Callable[[], T], close: Callable[[T], Awaitable[None]]
    ) -> T:
        """The running loop's object under ``key``: made by ``open_()`` on first use, closed
        by ``close(it)`` when the loop's resources are."""
        extras = self._resources().extras
        if key not in extras:
            made = open_()
            extras[key] = (made, lambda: close(made))
        found: T = extras[key][0]
        return found

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Runs a best-effort call in the background of the running loop; cancelled, not
        leaked, when the loop ends."""
        background = self._resources().background
        task = asyncio.ensure_future(coroutine)
        background.add(task)
        task.add_done_callback(background.discard)

    async def close(self) -> None:
        """Closes the running loop's resources (other loops' are theirs to close)."""
        resources = self._loops.get(asyncio.get_running_loop())
        if resources is None:
            return
        watcher = resources.watcher
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
