"""Fleets: N engine servers and a router, started together and stopped together.

``Fleet`` is what every launcher is: ``start()`` returns the addresses once the router sees
every server healthy, ``close()`` stops everything it started (also as a context manager).
``local.LocalFleet`` runs processes on this machine; ``ray_group.RayFleet`` places Ray actors.
Both supervise by one rule (``supervision``): ``supervise()`` restarts servers that die.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Self

from servers.fleet.standbys import StandbyRoles

if TYPE_CHECKING:
    from servers.common.supervision import ServerSupervisor

# The server flag that makes servers capture routed experts: a fleet whose servers take it
# starts its router with --routed-experts, so the OpenAI edge returns them.
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"


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
    #: Every server the fleet runs, in index order (its standbys too).
    servers: tuple[str, ...]
    #: Of ``servers``, the warm standbys now (kept current, given no data-plane calls).
    standbys: tuple[str, ...] = ()


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
    #: Which servers are warm standbys (``standbys``); a fleet with none unless it sets them.
    roles: StandbyRoles = StandbyRoles()

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
        if count < 1:
            raise ValueError(f"scale({count}): a fleet keeps at least one serving server")

        def resized(servers: list[str]) -> None:
            self.addresses = replace(
                self.addresses, servers=tuple(servers), standbys=self.roles.of(servers)
            )

        def before_removing(index: int) -> None:
            servers = self.addresses.servers
            self.roles.before_removing(index, servers, self._set_standby)
            self.addresses = replace(self.addresses, standbys=self.roles.of(servers))

        scale_fleet(
            count + len(self.roles.indexes),  # the standbys stay
            list(self.addresses.servers),
            router=self.addresses.router,
            start=lambda index: self._add_server(index, bound),
            stop=self._remove_server,
            resized=resized,
            before_removing=before_removing,
            on_event=self.on_event,
            supervision=self.supervision,
            timeout=bound,
        )
        return self.addresses

    @contextlib.contextmanager
    def _router_admin(self) -> Iterator[Any]:
        """A RouterAdmin stub on the fleet's router, for the length of the block."""
        import grpc

        from skyrl_grpc.v1 import router_pb2_grpc

        with grpc.insecure_channel(self.addresses.router) as channel:
            yield router_pb2_grpc.RouterAdminStub(channel)

    def _set_standby(self, address: str, standby: bool) -> None:
        """Tells the router a server's role (RouterAdmin SetStandby)."""
        from skyrl_grpc.v1 import router_pb2

        with self._router_admin() as admin:
            request = router_pb2.SetStandbyRequest(address=address, standby=standby)
            admin.SetStandby(request, timeout=10)

    def _promote_in_place_of(self, index: int, cause: str) -> None:
        """Server ``index`` died (the supervisor calls this at once, before restarting it):
        a warm standby takes its place (``standbys``)."""
        if not self.roles.indexes:
            return
        import grpc

        from skyrl_grpc.v1 import router_pb2

        servers = self.addresses.servers
        listing = router_pb2.ListBackendsRequest()
        try:
            with self._router_admin() as admin:
                promoted = self.roles.promote_in_place_of(
                    index,
                    servers,
                    lambda: admin.ListBackends(listing, timeout=10).backends,
                    self._set_standby,
                )
        except grpc.RpcError as error:
            self.on_event(f"no standby promoted for server {index}: the router said {error}")
            return
        if promoted is None:
            return
        self.addresses = replace(self.addresses, standbys=self.roles.of(servers))
        self.on_event(
            f"standby server {promoted} ({servers[promoted]}) promoted in place of server "
            f"{index} ({servers[index]}), which restarts as a standby"
        )

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
