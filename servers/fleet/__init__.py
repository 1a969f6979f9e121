"""Fleets: N engine servers and a router, started together and stopped together.

``Fleet`` is what every launcher is: ``start()`` returns the addresses once the router sees
every server healthy, ``close()`` stops everything it started (also as a context manager).
``local.LocalFleet`` runs processes on this machine; ``ray_group.RayFleet`` places Ray actors.
Both supervise by one rule (``supervision``): ``supervise()`` restarts servers that die.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Self


@dataclass(frozen=True)
class FleetAddresses:
    """Where a started fleet listens: the router and every engine server."""

    router: str
    servers: tuple[str, ...]


class Fleet(abc.ABC):
    """A startable, closable set of engine servers behind a router."""

    #: Set by ``start()``; empty before.
    addresses: FleetAddresses = FleetAddresses("", ())

    @abc.abstractmethod
    def start(self, timeout: float = 600) -> FleetAddresses:
        """Starts everything; returns once the router sees every server healthy."""

    @abc.abstractmethod
    def supervise(self) -> None:
        """Restarts servers that die, until ``close()`` (``supervision.ServerSupervisor``)."""

    @abc.abstractmethod
    def scale(self, count: int, timeout: float = 600) -> FleetAddresses:
        """Grows or shrinks the fleet to ``count`` servers (removed ones drained first)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops everything this fleet started (no process outlives it)."""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
