"""Where routing is decided: which backend takes a call.

A call with a session id goes to the session's backend on the hash ring (the first eligible
one clockwise from the session's point), so a multi-turn conversation keeps hitting the server
that holds its prefix cache; any other call goes to the least-loaded eligible backend that is
not paused (a paused one only when all are: the call then waits for Resume). Pure: it
reads the backends' state and load, and never touches the network, so every rule is tested
without one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypeVar

from .balancer import LeastOutstanding, RoundRobin
from .hash_ring import HashRing


class Candidate(Protocol):
    """What placement reads of a backend."""

    @property
    def address(self) -> str: ...

    @property
    def eligible(self) -> bool: ...  # healthy and not draining

    @property
    def in_flight(self) -> int: ...

    @property
    def paused(self) -> bool: ...  # generation paused: calls there wait for Resume


C = TypeVar("C", bound=Candidate)


class Placement:
    """The routing decision over a changing set of backends."""

    def __init__(self, balancing: str = "least-outstanding") -> None:
        self._ring = HashRing()
        self._balancer = RoundRobin() if balancing == "round-robin" else LeastOutstanding()

    def add(self, address: str) -> None:
        self._ring.add(address)

    def remove(self, address: str) -> None:
        self._ring.remove(address)

    def choose(
        self,
        session_id: str | None,
        backends: Mapping[str, C],
        exclude: frozenset[str] = frozenset(),
    ) -> C | None:
        """The backend for a call, among eligible ``backends`` not in ``exclude``."""

        def eligible(address: str) -> bool:
            backend = backends.get(address)
            return backend is not None and backend.eligible and address not in exclude

        if session_id:
            address = self._ring.lookup(session_id, eligible)
            return None if address is None else backends[address]
        candidates = [backends[a] for a in sorted(backends) if eligible(a)]
        running = [c for c in candidates if not c.paused]
        return self._balancer.pick(running or candidates, lambda b: b.in_flight)
