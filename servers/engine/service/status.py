"""ServerStatus servicer: the server's state streamed to routers as it changes.

``StatusChanges`` is the one place state changes are announced: the domain announces its own
(a pause or resume, a weight change, a session gained or lost), the process its draining.
Each Watch stream sends the state at once, then on every announcement, and otherwise every
interval with fresh load figures.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from servers.common.grpc_types import Context
from servers.engine.domain.descriptions import ServingStatus
from skyrl_grpc.v1 import status_pb2, status_pb2_grpc

DEFAULT_INTERVAL_MS = 1000
MIN_INTERVAL_MS = 100
# After a change, wait this long for more before reporting (new sessions come in bursts).
COALESCE_SECONDS = 0.01


class StatusChanges:
    """Wakes every watcher when the server's state changes."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def announce(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        """Returns at the next announcement, or after ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)


class ServerStatusServicer(status_pb2_grpc.ServerStatusServicer):
    """``serving``: the status now (None while the engine starts); ``draining``: whether the
    server is shutting down; ``changes``: where changes are announced; ``sampling_seed``: the
    seed the engine's sampler started with."""

    def __init__(
        self,
        serving: Callable[[], ServingStatus | None],
        draining: Callable[[], bool],
        changes: StatusChanges,
        sampling_seed: int | None = None,
    ) -> None:
        self._serving = serving
        self._draining = draining
        self._changes = changes
        self._sampling_seed = sampling_seed

    def snapshot(
        self, reported: frozenset[str] | None
    ) -> tuple[status_pb2.WatchResponse, frozenset[str] | None]:
        """The status now, with sessions as the change since ``reported`` (None: all of them),
        and the sessions it reports."""
        now = self._serving()
        status = status_pb2.WatchResponse(draining=self._draining())
        if now is None:
            status.sessions_complete = True
            return status, None
        if self._sampling_seed is not None:
            status.sampling_seed = self._sampling_seed
        status.paused = now.paused
        status.weight_version = now.weight_version
        status.running_requests = now.running_requests
        status.waiting_requests = now.waiting_requests
        status.kv_cache_usage = now.kv_cache_usage
        status.prompt_tokens = now.prompt_tokens
        status.cached_prompt_tokens = now.cached_prompt_tokens
        status.adapters.extend(now.adapters)
        for record in now.recent_updates:
            status.recent_updates.add(
                weight_version=record.weight_version,
                outcome=record.outcome,
                phase_seconds=record.phase_seconds,
                bytes=record.bytes,
                ended_at_unix_seconds=record.ended_at,
            )
        live = now.sessions
        status.live_sessions = len(live)
        if reported is None:
            status.sessions_complete = True
            status.sessions_added.extend(sorted(live))
        else:
            status.sessions_added.extend(sorted(live - reported))
            status.sessions_removed.extend(sorted(reported - live))
        return status, live

    async def Watch(
        self, request: status_pb2.WatchRequest, context: Context
    ) -> AsyncIterator[status_pb2.WatchResponse]:
        interval = max(request.interval_ms or DEFAULT_INTERVAL_MS, MIN_INTERVAL_MS) / 1000
        reported: frozenset[str] | None = None
        while True:
            status, reported = self.snapshot(reported)
            yield status
            if self._draining():
                return
            await self._changes.wait(interval)
            await asyncio.sleep(COALESCE_SECONDS)  # one message for a burst of changes
