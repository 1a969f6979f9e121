"""The sessions an engine server holds: the source of truth every placer follows.

A generation request carrying ``x-session-id`` makes its session live here (or keeps it live);
``FinishSession`` ends it, and so does idleness (``--session-idle-seconds`` without a
request). ``ServerStatus`` streams the set to routers and clients, whole first, then as
changes, so they place each session's next turn here without any state of their own: every
change is announced (``on_change``) as it happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from skyrl_grpc.placement.session_directory import SESSION_IDLE_SECONDS


class LiveSessions:
    """Session id -> when its last request came."""

    def __init__(
        self,
        idle_seconds: float = SESSION_IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._on_change = on_change  # placers learn where sessions live (ServerStatus)
        self._last_seen: dict[str, float] = {}

    def touch(self, session: str) -> bool:
        """A request of ``session`` came; returns True (and announces it) if the session is
        new here."""
        new = session not in self._last_seen
        self._last_seen[session] = self._clock()
        if new:
            self._on_change()
        return new

    def finish(self, session: str) -> bool:
        """Ends ``session``; returns whether it was live (and announces it if so)."""
        found = self._last_seen.pop(session, None) is not None
        if found:
            self._on_change()
        return found

    def expire(self) -> list[str]:
        """Ends the sessions idle for longer than ``idle_seconds``; returns them (announced
        when there are any)."""
        oldest = self._clock() - self.idle_seconds
        idle = [s for s, seen in self._last_seen.items() if seen < oldest]
        for session in idle:
            del self._last_seen[session]
        if idle:
            self._on_change()
        return idle

    def snapshot(self) -> frozenset[str]:
        return frozenset(self._last_seen)

    def __len__(self) -> int:
        return len(self._last_seen)
