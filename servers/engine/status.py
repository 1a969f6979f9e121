"""ServerStatus servicer: the server's state streamed to routers as it changes.

``StatusChanges`` is the one place state changes are announced (pause, resume, a weight
change, draining); each Watch stream sends the state at once, then on every announcement, and
otherwise every interval with fresh load figures.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from skyrl_grpc.v1 import status_pb2, status_pb2_grpc

from ..common.grpc_types import Context
from .engine_parts import EngineParts
from .serving_state import ServingState

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
    def __init__(self, state: ServingState[EngineParts], changes: StatusChanges) -> None:
        self._state = state
        self._changes = changes

    def snapshot(
        self, reported: frozenset[str] | None
    ) -> tuple[status_pb2.WatchResponse, frozenset[str] | None]:
        """The status now, with sessions as the change since ``reported`` (None: all of them),
        and the sessions it reports."""
        parts = self._state.started
        status = status_pb2.WatchResponse(draining=self._state.draining)
        if parts is None:
            status.sessions_complete = True
            return status, None
        engine = parts.engine
        load = engine.load()
        status.paused = engine.paused
        status.weight_version = parts.weights.version
        status.running_requests = load.running
        status.waiting_requests = load.waiting
        status.kv_cache_usage = load.kv_cache_usage
        status.prompt_tokens = engine.prompt_tokens
        status.cached_prompt_tokens = engine.cached_prompt_tokens
        live = parts.sessions.snapshot()
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
            if self._state.draining:
                return
            await self._changes.wait(interval)
            await asyncio.sleep(COALESCE_SECONDS)  # one message for a burst of changes
