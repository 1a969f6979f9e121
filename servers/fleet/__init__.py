"""Fleets: N engine servers and a router, started together and stopped together.

``Fleet`` is what every launcher is: ``start()`` returns the addresses once the router sees
every server healthy, ``close()`` stops everything it started (also as a context manager).
``local.LocalFleet`` runs processes on this machine; ``ray_group.RayFleet`` places Ray actors.
Both supervise by one rule (``supervision``): ``supervise()`` restarts servers that die.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from servers.common.supervision import ServerSupervisor


class FleetStartFailed(RuntimeError):
    """A server or the router of a starting fleet failed, or was still starting when the start
    timeout ran out; the fleet has stopped what it started."""

    @classmethod
    def still_starting(cls, name: str) -> FleetStartFailed:
        """``name`` (a server, the router) was loading still when the start timeout ran out:
        out of time, not failed; what to raise says how to give it more."""
        return cls(
            f"{name} was still starting when the start timeout ran out "
            "(raise it with --start-timeout for a large model or a busy machine)"
        )


@dataclass(frozen=True)
class FleetAddresses:
    """Where a started fleet listens: the router and every engine server."""

    router: str
    servers: tuple[str, ...]


class Fleet(abc.ABC):
    """A startable, closable set of engine servers behind a router."""

    #: Set by ``start()``; empty before.
    addresses: FleetAddresses = FleetAddresses("", ())
    #: The router's OpenAI HTTP edge and Prometheus ports, once started (None: not served).
    http_port: int | None = None
    metrics_port: int | None = None
    #: Set by ``supervise()``.
    supervision: ServerSupervisor | None = None
    #: Receives one line per supervision or scaling event.
    on_event: Callable[[str], None] = staticmethod(lambda line: print(line, flush=True))
    #: Seconds a server may take to become ready, when the fleet starts, when one is restarted
    #: and when ``scale()`` adds one: loading a large model, or any model on a busy machine,
    #: can take longer than the default.
    start_timeout: float = 600

    @abc.abstractmethod
    def start(self, timeout: float | None = None) -> FleetAddresses:
        """Starts everything; returns once the router sees every server healthy (within
        ``timeout`` seconds; default ``start_timeout``)."""

    def start_bound(self, timeout: float | None) -> float:
        """Seconds a start may take: ``timeout`` where a caller gives one, else
        ``start_timeout``."""
        return self.start_timeout if timeout is None else timeout

    @abc.abstractmethod
    def supervise(self) -> None:
        """Restarts servers that die, until ``close()`` (``supervision.ServerSupervisor``)."""

    def scale(self, count: int, timeout: float | None = None) -> FleetAddresses:
        """Grows or shrinks the fleet to ``count`` servers by the one rule of ``scaling``: an
        added server joins the router (behind until the trainer's next update reaches it); a
        removed one (the newest first) is drained at the router, then stopped."""
        from servers.fleet.scaling import scale_fleet

        bound = self.start_bound(timeout)

        def resized(servers: list[str]) -> None:
            self.addresses = replace(self.addresses, servers=tuple(servers))

        scale_fleet(
            count,
            list(self.addresses.servers),
            router=self.addresses.router,
            start=lambda index: self._add_server(index, bound),
            stop=self._remove_server,
            resized=resized,
            on_event=self.on_event,
            supervision=self.supervision,
            timeout=bound,
        )
        return self.addresses

    @abc.abstractmethod
    def _add_server(self, index: int, timeout: float) -> str:
        """Starts server ``index`` (one past the last); returns its address once it is ready."""

    @abc.abstractmethod
    def _remove_server(self, index: int) -> None:
        """Stops the last server, ``index`` (already drained and no longer supervised)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops everything this fleet started (no process outlives it)."""

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:  # Ctrl-C while starting too: nothing started is left running
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
