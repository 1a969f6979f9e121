"""What the fleet page (``/fleet`` on the router's HTTP port) shows: every server as the router
sees it (health, weight version, load, sessions, adapters, its last weight updates with their
phases) and what happened to the fleet lately (servers lost and back, joined and removed,
streams migrated), as one JSON-ready dict.

``FleetEvents`` is the router's short memory of those happenings: the router records a
server's health changes and migrations there as they happen (``router_server``, ``proxy``).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from servers.router.backends import HEALTHY, BackendPool
from skyrl_grpc.sampling_seeds import reported_seed

# Events kept for the page: enough to see the last restarts and migrations.
EVENTS_KEPT = 50


class FleetEvents:
    """The last happenings, newest last; and each server's last known health."""

    def __init__(self) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self._healthy: dict[str, bool] = {}
        self._standby: dict[str, bool] = {}

    def record(self, kind: str, server: str, detail: str = "") -> None:
        self._events.append({"at": time.time(), "kind": kind, "server": server, "detail": detail})

    def health(self, server: str, healthy: bool, state: str) -> None:
        """A server's health as the router sees it now: an event when it changed (``joined``
        the first time it is seen healthy; a server still starting is not lost)."""
        before = self._healthy.get(server)  # None: never seen healthy yet
        if healthy and before is not True:
            self._healthy[server] = True
            self.record("back" if before is False else "joined", server)
        elif not healthy and before is True:
            self._healthy[server] = False
            self.record("lost", server, state)

    def role(self, server: str, standby: bool) -> None:
        """A server's role now: an event when a known server's changed (``promoted``: a
        standby made serving; ``standby``: a server made a standby)."""
        before = self._standby.get(server)
        self._standby[server] = standby
        if before is not None and before != standby:
            self.record("standby" if standby else "promoted", server)

    def removed(self, server: str) -> None:
        self._healthy.pop(server, None)
        self._standby.pop(server, None)
        self.record("removed", server)

    def recent(self) -> list[dict[str, Any]]:
        return list(self._events)


def fleet_view(pool: BackendPool, events: FleetEvents, replica: int | None) -> dict[str, Any]:
    """The page's data: servers in membership order, their updates, the events."""
    sessions = pool.placement.sessions.live_sessions()
    servers = []
    for backend in pool.backends:
        status = backend.status
        servers.append(
            {
                "address": backend.address,
                "state": backend.state_name,
                "healthy": backend.state == HEALTHY,
                "standby": backend.standby,
                "paused": status.paused,
                "draining": status.draining,
                "weight_version": status.weight_version,
                "running": status.running_requests,
                "waiting": status.waiting_requests,
                "kv_cache_usage": round(status.kv_cache_usage, 4),
                "in_flight": backend.in_flight,
                "live_sessions": sessions[backend.address],
                "adapters": list(status.adapters),
                "sampling_seed": reported_seed(status),
                "recent_updates": [
                    {
                        "weight_version": record.weight_version,
                        "outcome": record.outcome,
                        "phase_seconds": {
                            name: round(seconds, 4)
                            for name, seconds in sorted(record.phase_seconds.items())
                        },
                        "bytes": record.bytes,
                        "ended_at": record.ended_at_unix_seconds,
                    }
                    for record in status.recent_updates
                ],
            }
        )
    return {"now": time.time(), "replica": replica, "servers": servers, "events": events.recent()}
