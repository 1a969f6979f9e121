"""The one supervision rule of every fleet (local processes and Ray actors alike), for its
servers and for its router.

Each pass looks at every process it watches (servers; or the router, ``noun="router"``): one
that is dead (its process exited, its actor or node died, its engine died) is started again
after a backoff — the first restart waits ``first_delay``, each further one twice as long up
to ``max_delay``; a server that stayed up ``reset_after`` seconds starts from the first delay
again. A server that fails
``max_failures`` times in a row (a start that never became ready, or a death within
``reset_after`` of its start) is reported with its last cause and left down: a crash loop is a
bug to fix, not something to retry forever.

A restarted server reads the fleet's current weights from a healthy peer before it serves
(``servers.engine.peers.catch_up``, where the fleet passes it its peers: local processes);
where none can be read it serves the weights it started from until the trainer's next
``update_weights``, which sends it the whole weights in the same transaction as the others'
deltas (a delta needs the version the fleet serves); ``client.weight_versions()`` shows it
behind meanwhile.

Plain callables in, so ``LocalFleet`` and ``RayFleet`` share it and tests drive it without
processes: ``death(index)`` says why a server is down (None: alive), ``restart(index)`` starts it
again and returns its address once it is ready (raising if it never became ready).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """How a fleet restarts servers that die."""

    first_delay: float = 1.0
    max_delay: float = 30.0
    reset_after: float = 60.0
    max_failures: int = 5


@dataclass
class _Watched:
    started: float
    delay: float
    failures: int = 0
    given_up: str | None = None


@dataclass
class ServerSupervisor:
    """Restarts the fleet's dead servers by ``policy``; see the module docstring."""

    count: int
    death: Callable[[int], str | None]
    restart: Callable[[int], str]
    on_event: Callable[[str], None]
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    # What it watches, in its messages: "server" or "router".
    noun: str = "server"
    # What a process that is back serves, said after "is back" (servers: their initial weights).
    back_note: str = "it serves the fleet's weights, or its initial ones if no peer had newer"
    # Called as (index, old address, new address) when a restarted server's address changed
    # (on Ray it may come back on another node): the fleet updates the router's membership.
    on_moved: Callable[[int, str, str], None] = lambda index, old, new: None
    # Called as (index, cause) as soon as a death is seen, before the backoff and the restart
    # (a fleet promotes a warm standby in its place there).
    on_death: Callable[[int, str], None] = lambda index, cause: None
    addresses: list[str] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], bool] = lambda seconds: False  # True: stop waiting (closing)
    restarts: list[int] = field(init=False)
    # Passes completed (each looked at every server once): what a caller waits on to know the
    # supervisor has seen a change.
    passes: int = field(init=False, default=0)
    # Held by each pass and by a fleet changing its size, so a server being removed is never
    # mistaken for a dead one.
    lock: threading.RLock = field(init=False, default_factory=threading.RLock)
    _watched: list[_Watched] = field(init=False)

    def __post_init__(self) -> None:
        now = self.clock()
        self.restarts = [0] * self.count
        self._watched = [_Watched(now, self.policy.first_delay) for _ in range(self.count)]

    @property
    def given_up(self) -> dict[int, str]:
        """Servers left down after failing ``max_failures`` times in a row, with the cause."""
        return {i: w.given_up for i, w in enumerate(self._watched) if w.given_up is not None}

    def resize(self, addresses: list[str]) -> None:
        """The fleet grew or shrank (servers added or removed at the end): watch ``addresses``.
        Call it holding ``lock`` before stopping a removed server."""
        now = self.clock()
        count = len(addresses)
        self._watched = self._watched[:count] + [
            _Watched(now, self.policy.first_delay) for _ in range(count - len(self._watched))
        ]
        self.restarts = self.restarts[:count] + [0] * (count - len(self.restarts))
        self.addresses[:] = addresses
        self.count = count

    def check_once(self) -> None:
        """One pass: restarts each server found dead (blocking until it is ready or failed)."""
        with self.lock:
            for index, watched in enumerate(self._watched):
                if watched.given_up is not None:
                    continue
                cause = self.death(index)
                if cause is None:
                    continue
                self._handle_death(index, watched, cause)
            self.passes += 1

    def _handle_death(self, index: int, watched: _Watched, cause: str) -> None:
        name = f"{self.noun} {index} ({self._address(index)})"
        try:
            self.on_death(index, cause)
        except Exception:  # the restart below still happens
            log.exception("handling the death of %s failed", name)
        if self.clock() - watched.started >= self.policy.reset_after:
            watched.delay, watched.failures = self.policy.first_delay, 0
        while True:
            watched.failures += 1
            if watched.failures > self.policy.max_failures:
                watched.given_up = cause
                self.on_event(
                    f"{name} failed {self.policy.max_failures} times in a row, last: {cause}; "
                    "not restarting it (fix the cause, then restart the fleet)"
                )
                return
            self.on_event(f"{name} died ({cause}); restarting in {watched.delay:.0f} s")
            if self.sleep(watched.delay):
                return
            watched.delay = min(watched.delay * 2, self.policy.max_delay)
            watched.started = self.clock()
            self.restarts[index] += 1
            try:
                address = self.restart(index)
            except Exception as error:  # it never became ready: counts as a failure
                cause = f"the restart failed: {error}"
                continue
            old = self._address(index)
            if self.addresses and address != old:
                self.addresses[index] = address
                self.on_moved(index, old, address)
            note = f"; {self.back_note}" if self.back_note else ""
            self.on_event(f"{self.noun} {index} ({address}) is back{note}")
            return

    def _address(self, index: int) -> str:
        return self.addresses[index] if index < len(self.addresses) else "?"

    def start(self, stop: threading.Event, interval: float, name: str) -> threading.Thread:
        """Runs the passes in a daemon thread (returned) until ``stop`` is set."""
        thread = threading.Thread(target=self.run, args=(stop, interval), name=name, daemon=True)
        thread.start()
        return thread

    def run(self, stop: threading.Event, interval: float = 0.5) -> None:
        """Passes every ``interval`` seconds until ``stop`` is set."""
        while not stop.wait(interval):
            try:
                self.check_once()
            except Exception:  # a broken check must not end supervision
                log.exception("supervising the fleet failed; trying again")
