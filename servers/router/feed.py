"""The routing view clients follow (RouterAdmin.WatchBackends), computed once for all of them.

Every ``interval`` the feed compares the router's view (members and what placement reads of
them, where every session lives) with the one it last published, and hands the changes to each
watcher's queue. A new watcher starts from the published view, complete, so the changes that
follow apply to exactly what it has. A watcher that falls behind (its queue full) is sent the
complete view again instead of the changes it missed. The cost of a tick is one pass over the
live sessions whatever the number of watchers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from skyrl_grpc.placement import PlacementPolicy
from skyrl_grpc.v1 import router_pb2

# How often the view is compared with the published one (the update rate cap).
INTERVAL_SECONDS = 0.05
# A message at least this often even when nothing changed, so watchers know the feed lives.
HEARTBEAT_SECONDS = 5.0
# Changes a watcher may have waiting before it is sent the whole view instead.
QUEUE_LIMIT = 256


def routing_fields(backend: router_pb2.Backend) -> tuple[object, ...]:
    """What placement reads of a backend: a change of these is worth an update."""
    return (
        backend.address,
        backend.state,
        backend.paused,
        backend.running_requests + backend.waiting_requests,
        backend.live_sessions,
        backend.weight_version,  # a backend that is behind gets no calls
        backend.standby,  # nor does a standby
    )


@dataclass(eq=False)  # by identity: watchers live in a set
class _Watcher:
    queue: asyncio.Queue[router_pb2.WatchBackendsResponse | None] = field(
        default_factory=lambda: asyncio.Queue(QUEUE_LIMIT)
    )
    resync: bool = False  # it fell behind: send it the whole view next


class RoutingFeed:
    """Publishes ``placement``'s view with the members ``describe()`` lists."""

    def __init__(
        self,
        describe: Callable[[], list[router_pb2.Backend]],
        placement: PlacementPolicy,
        interval: float = INTERVAL_SECONDS,
    ) -> None:
        self._describe = describe
        self._placement = placement
        self._interval = interval
        self._watchers: set[_Watcher] = set()
        self._backends: list[router_pb2.Backend] = []
        self._fields: list[tuple[object, ...]] | None = None
        self._sessions: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    def _message(self, **changes: object) -> router_pb2.WatchBackendsResponse:
        epsilon = float(getattr(self._placement, "epsilon", 0.0))
        return router_pb2.WatchBackendsResponse(
            backends=self._backends,
            placement=self._placement.name,
            epsilon=epsilon if math.isfinite(epsilon) else 0.0,
            **changes,  # type: ignore[arg-type]
        )

    def _complete(self) -> router_pb2.WatchBackendsResponse:
        return self._message(
            complete=True,
            sessions_added=[
                router_pb2.SessionPlacement(session_id=s, address=a)
                for s, a in self._sessions.items()
            ],
        )

    def publish(self, force: bool = False) -> router_pb2.WatchBackendsResponse | None:
        """Compares the view with the published one; returns (and queues) the changes, if any
        (``force``: an update even without changes, the heartbeat)."""
        backends = self._describe()
        fields = [routing_fields(b) for b in backends]
        sessions = self._placement.sessions.snapshot()
        added = [
            router_pb2.SessionPlacement(session_id=s, address=a)
            for s, a in sessions.items()
            if self._sessions.get(s) != a
        ]
        removed = [s for s in self._sessions if s not in sessions]
        if self._fields is not None and fields == self._fields and not (added or removed or force):
            return None
        self._backends, self._fields, self._sessions = backends, fields, sessions
        update = self._message(sessions_added=added, sessions_removed=removed)
        for watcher in self._watchers:
            if watcher.resync:
                continue
            try:
                watcher.queue.put_nowait(update)
            except asyncio.QueueFull:
                watcher.resync = True
                with contextlib.suppress(asyncio.QueueFull):
                    watcher.queue.put_nowait(None)  # wake it if it waits on an empty queue
        return update

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(self._interval)
            heartbeat = loop.time() - last > HEARTBEAT_SECONDS
            if self.publish(force=heartbeat) is not None:
                last = loop.time()

    async def watch(self) -> AsyncGenerator[router_pb2.WatchBackendsResponse, None]:
        """The view, complete first, then its changes; for as long as the caller reads."""
        self.publish()  # a fresh baseline: the complete view below is the published one
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        watcher = _Watcher()
        self._watchers.add(watcher)
        try:
            yield self._complete()
            while True:
                update = await watcher.queue.get()
                if watcher.resync:
                    while not watcher.queue.empty():
                        watcher.queue.get_nowait()
                    watcher.resync = False
                    yield self._complete()
                elif update is not None:
                    yield update
        finally:
            self._watchers.discard(watcher)
            if not self._watchers and self._task is not None:
                self._task.cancel()
                self._task = None
