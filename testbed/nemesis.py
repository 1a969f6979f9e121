"""The nemesis: named faults a test or a benchmark schedules while a workload runs, each healed
by the nemesis too, and every host healed when it stops (Jepsen's nemesis, on this testbed).

A fault is one of ``KINDS`` aimed at hosts by role (``Roles``: the router's host, the
trainer's, the servers'):

- ``partition``: a host cut off from everyone (every packet dropped), then healed;
- ``link-down``: a host's link down (no carrier), then up;
- ``pair``: two hosts cut off from each other (router <-> a server, trainer <-> a server, a
  server <-> another: the relay's parent and child);
- ``loss-delay``: 2% of packets dropped each way and 40 ms round trips on every link;
- ``flap``: a host's link down 2 s, up 5 s, again and again for the fault's length;
- ``kill``: every process of a server's host killed; healed by starting its server again
  (``Roles.restart``), which reads the fleet's weights from its peers before it serves.

Each applied fault is a ``Fault`` record (what, when it began and was healed, which servers the
router could not reach meanwhile: ``outages``, what ``testbed.history.check`` is told), so a
run's history is checked against the faults it met. ``schedule`` draws a random schedule from
a seed; ``run`` applies one in a thread of its own until it ends or ``stop`` is called.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from testbed import Host, Testbed
from testbed.history import Outage

KINDS = ("partition", "link-down", "pair", "loss-delay", "flap", "kill")
LOSS_PERCENT = 2.0
DELAY_MS = 20.0  # each way: 40 ms between any two hosts
FLAP_DOWN_SECONDS = 2.0
FLAP_UP_SECONDS = 5.0


@dataclass
class Roles:
    """The hosts a nemesis aims at, by what runs on them. ``servers``: each server host and its
    server's address; ``restart``: starts the server of a killed host again and returns once
    it serves (the heal of ``kill``)."""

    router: Host
    trainer: Host
    servers: dict[str, Host]
    restart: Callable[[Host], None]
    client: Host | None = None

    def address_of(self, host: Host) -> str | None:
        for address, server in self.servers.items():
            if server is host:
                return address
        return None


@dataclass
class Fault:
    """One fault as it happened: ``kind`` on ``hosts`` (names), from ``started`` until
    ``healed`` (the hosts' monotonic clock, which every host shares)."""

    kind: str
    hosts: tuple[str, ...]
    seconds: float
    started: float = 0.0
    healed: float = 0.0
    # Servers (addresses) the router could not reach while it lasted.
    unreachable: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.kind} {' | '.join(self.hosts)}"


@dataclass(frozen=True)
class Planned:
    """A fault to apply: ``kind`` on ``hosts`` for ``seconds``, ``after`` seconds of calm."""

    kind: str
    hosts: tuple[Host, ...]
    seconds: float
    after: float


class Nemesis:
    """Applies faults on ``bed`` (see the module docstring); records each in ``faults``."""

    def __init__(self, bed: Testbed, roles: Roles) -> None:
        self.bed = bed
        self.roles = roles
        self.faults: list[Fault] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # -- one fault ------------------------------------------------------------------------

    def apply(self, kind: str, hosts: tuple[Host, ...], seconds: float) -> Fault:
        """``kind`` on ``hosts`` for ``seconds`` (or until ``stop``), then healed; blocks."""
        if kind not in KINDS:
            raise ValueError(f"fault {kind!r}: one of {', '.join(KINDS)}")
        fault = Fault(kind, tuple(h.name for h in hosts), seconds)
        fault.unreachable = self._unreachable(kind, hosts)
        self.faults.append(fault)
        fault.started = time.monotonic()
        try:
            if kind == "flap":
                self._flap(hosts[0], seconds)
            else:
                self._start(kind, hosts)
                self._stop.wait(seconds)
        finally:
            self._heal(kind, hosts)
            fault.healed = time.monotonic()
        return fault

    def _start(self, kind: str, hosts: tuple[Host, ...]) -> None:
        bed = self.bed
        if kind == "partition":
            bed.cut(hosts[0])
        elif kind == "link-down":
            bed.cut(hosts[0], "down")
        elif kind == "pair":
            bed.cut_between(hosts[0], hosts[1])
        elif kind == "loss-delay":
            for host in hosts:
                bed.lose(host, LOSS_PERCENT)
                bed.delay(host, DELAY_MS)
        elif kind == "kill":
            hosts[0].kill()

    def _heal(self, kind: str, hosts: tuple[Host, ...]) -> None:
        bed = self.bed
        if kind == "pair":
            bed.heal_between(hosts[0], hosts[1])
        elif kind == "loss-delay":
            for host in hosts:
                bed.lose(host, 0)
                bed.delay(host, 0)
        elif kind == "kill":
            self.roles.restart(hosts[0])
        else:
            bed.heal(hosts[0])

    def _flap(self, host: Host, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until and not self._stop.is_set():
            self.bed.cut(host, "down")
            try:
                self._stop.wait(FLAP_DOWN_SECONDS)
            finally:
                self.bed.heal(host)
            self._stop.wait(FLAP_UP_SECONDS)

    def _unreachable(self, kind: str, hosts: tuple[Host, ...]) -> list[str]:
        """The servers the router cannot reach during ``kind`` on ``hosts``."""
        roles = self.roles
        if kind == "loss-delay":
            return []  # slower, never cut off
        if kind == "pair":
            a, b = hosts
            if roles.router in (a, b):
                other = b if a is roles.router else a
                address = roles.address_of(other)
                return [address] if address else []
            return []  # the router still reaches both
        (host,) = hosts
        if host is roles.router:
            return list(roles.servers)
        address = roles.address_of(host)
        return [address] if address else []

    # -- a schedule -----------------------------------------------------------------------

    def schedule(self, seconds: float, seed: int, kinds: tuple[str, ...] = KINDS) -> list[Planned]:
        """A random schedule of about ``seconds``: each fault of ``kinds`` on hosts it can
        take, 5-15 s long (a flap 14 s: two of its cycles), with 5-20 s of calm before it. One
        fault at a time; never the router's host killed (its role has no restart)."""
        rng = random.Random(seed)
        roles = self.roles
        servers = list(roles.servers.values())
        planned: list[Planned] = []
        spent = 0.0
        while spent < seconds:
            kind = rng.choice(kinds)
            hosts: tuple[Host, ...]
            if kind == "kill":
                hosts = (rng.choice(servers),)
            elif kind == "pair":
                peers = [roles.router, roles.trainer, *servers]
                server = rng.choice(servers)
                hosts = (rng.choice([p for p in peers if p is not server]), server)
            elif kind == "loss-delay":
                hosts = tuple(h for h in self.bed.hosts)
            else:
                hosts = (rng.choice([roles.router, *servers]),)
            length = 14.0 if kind == "flap" else rng.uniform(5.0, 15.0)
            after = rng.uniform(5.0, 20.0)
            planned.append(Planned(kind, hosts, length, after))
            spent += length + after
        return planned

    def run(self, planned: list[Planned]) -> None:
        """Applies ``planned`` in a thread of its own (``join`` to wait, ``stop`` to end it
        early: the fault under way is healed)."""

        def go() -> None:
            try:
                for step in planned:
                    if self._stop.wait(step.after):
                        return
                    self.apply(step.kind, step.hosts, step.seconds)
            except BaseException as error:  # reported by join
                self.error = error
            finally:
                self.heal_all()

        self._thread = threading.Thread(target=go, name="nemesis", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.join()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            raise self.error

    def heal_all(self) -> None:
        """Every link healed (a killed host's server is restarted by its fault's heal)."""
        self.bed.heal_all()

    def outages(self) -> list[Outage]:
        """What the history checker is told: each server the router could not reach, when."""
        return [
            Outage(server, fault.started, fault.healed)
            for fault in self.faults
            for server in fault.unreachable
        ]
