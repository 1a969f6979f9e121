"""Where a call goes: the placement policies the router and self-routing clients share.

A call without a session goes to the least-loaded eligible backend that is not paused. A call
with a session goes where the session lives; a session that lives nowhere (new, or its server
left) is placed by the policy:

- ``BoundedLoadPolicy`` (default, ``bounded-load``): the backend with the fewest live sessions,
  then the least work in flight (as the servers report it); ties are broken by a hash of
  (session, backend), never at random. The session then stays there until it ends
  (``FinishSession``, or idleness at its server) -- unless its backend holds more than
  ``max(floor((1 + epsilon) * mean), ceil(mean) + 1)`` live sessions, which happens when
  sessions elsewhere end or a backend joins: then its next turn moves to the least-loaded
  backend (one prefix recompute, instead of a server that paces the whole fleet). A backend
  that leaves moves only its own sessions; a backend that joins takes new sessions first (it
  holds none), then the excess of overfull ones.
- ``sticky-least-loaded``: the same without the bound (epsilon infinite); what SkyRL's Rust
  router calls ``sticky_least_loaded``, for comparison.
- ``ConsistentHashPolicy`` (``consistent-hash``): the session's owner on a hash ring, walking on
  past ineligible backends; balanced only on average.

Under every policy a backend that is behind -- healthy, but serving an older weight version
than another healthy one (a server restarted or added since the fleet's last update, until the
trainer's next update reaches it) -- gets no calls while one on the newest version can take
them: a rollout never mixes the fleet's weights with stale ones. A continuation goes further
(``min_version``, its tokens' version): never to a backend older than its tokens, even when that
backend is the newest one left (the others lost), so a sample's versions never go backwards.

Both are deterministic functions of what they are shown (membership, reported sessions and
load): two router replicas, a router that restarted, and a trainer client routing itself place
a session the same way, with no state shared between them. Pure: no network; every rule is
tested directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from .balancer import LeastOutstanding, RoundRobin
from .hash_ring import HashRing, stable_hash
from .session_directory import SessionDirectory

POLICIES = ("bounded-load", "consistent-hash", "sticky-least-loaded")
DEFAULT_EPSILON = 0.25


class Candidate(Protocol):
    """What placement reads of a backend."""

    @property
    def address(self) -> str: ...

    @property
    def eligible(self) -> bool: ...  # healthy and not draining

    @property
    def paused(self) -> bool: ...  # generation paused: calls there wait for Resume

    @property
    def in_flight(self) -> int: ...  # calls this placer has sent there and not seen end

    @property
    def reported_load(self) -> int: ...  # requests the server itself runs and queues

    @property
    def weight_version(self) -> int: ...  # the weights it serves, as it reports (0: unknown)


C = TypeVar("C", bound=Candidate)


def behind(backends: Mapping[str, Candidate], min_version: int = 0) -> frozenset[str]:
    """Eligible backends serving an older weight version than the newest eligible one's, or
    than ``min_version``."""
    eligible = [b for b in backends.values() if b.eligible]
    newest = max((b.weight_version for b in eligible), default=0)
    floor = max(newest, min_version)
    return frozenset(b.address for b in eligible if b.weight_version < floor)


Eligible = Callable[[str], bool]
# Told when a live session moves: (session, the backend it left, the one it went to).
OnMove = Callable[[str, str, str], None]


class PlacementPolicy:
    """What every policy shares: membership, the session directory, session-less calls."""

    name = ""
    # Sessions stay where they were placed (the directory decides), rather than wherever the
    # rule says now.
    sticky = True

    def __init__(
        self, directory: SessionDirectory | None = None, balancing: str = "least-outstanding"
    ) -> None:
        self.sessions = directory or SessionDirectory()
        # The router sends FinishSession to the backend a session left, so that backend stops
        # reporting (and counting) it.
        self.on_move: OnMove | None = None
        self._ring = HashRing()
        self._balancer: LeastOutstanding | RoundRobin = (
            RoundRobin() if balancing == "round-robin" else LeastOutstanding()
        )

    def add(self, address: str) -> None:
        self._ring.add(address)

    def remove(self, address: str) -> None:
        self._ring.remove(address)
        self.sessions.forget_server(address)

    def choose(
        self,
        session_id: str | None,
        backends: Mapping[str, C],
        exclude: frozenset[str] = frozenset(),
        min_version: int = 0,
    ) -> C | None:
        """The backend for a call, among eligible ``backends`` not in ``exclude`` nor behind
        (the newest eligible version, or ``min_version``)."""
        exclude = exclude | behind(backends, min_version)

        def eligible(address: str) -> bool:
            backend = backends.get(address)
            return backend is not None and backend.eligible and address not in exclude

        if not session_id:
            candidates = [backends[a] for a in sorted(backends) if eligible(a)]
            running = [c for c in candidates if not c.paused]
            return self._balancer.pick(running or candidates, lambda b: b.in_flight)
        if not self.sticky:
            return self._place(session_id, backends, eligible)
        home = self.sessions.home(session_id)
        if home is not None and eligible(home) and not self._overfull(home, backends, eligible):
            self.sessions.touch(session_id)
            return backends[home]
        chosen = self._place(session_id, backends, eligible)
        if chosen is not None:
            left = self.sessions.place(session_id, chosen.address)
            if left is not None and self.on_move is not None:
                self.on_move(session_id, left, chosen.address)
        return chosen

    def _place(self, session_id: str, backends: Mapping[str, C], eligible: Eligible) -> C | None:
        """Where a session that lives nowhere eligible (or must move) goes."""
        raise NotImplementedError

    def _overfull(self, home: str, backends: Mapping[str, C], eligible: Eligible) -> bool:
        """True if ``home`` holds too many sessions to keep this one."""
        return False


class ConsistentHashPolicy(PlacementPolicy):
    """A session's backend is its owner on the hash ring (see ``hash_ring``), always: when the
    owner is back from an outage, its sessions are too."""

    name = "consistent-hash"
    sticky = False

    def _place(self, session_id: str, backends: Mapping[str, C], eligible: Eligible) -> C | None:
        address = self._ring.lookup(session_id, eligible)
        return None if address is None else backends[address]


class BoundedLoadPolicy(PlacementPolicy):
    """New sessions go to the least-loaded backend; no turn runs on a backend holding more
    than (1 + epsilon) x the mean (infinite epsilon: sticky-least-loaded)."""

    name = "bounded-load"

    def __init__(
        self,
        directory: SessionDirectory | None = None,
        balancing: str = "least-outstanding",
        epsilon: float = DEFAULT_EPSILON,
    ) -> None:
        super().__init__(directory, balancing)
        self.epsilon = epsilon
        if math.isinf(epsilon):
            self.name = "sticky-least-loaded"

    def capacity(self, live_sessions: int, backends: int) -> int | float:
        """The most sessions one backend may hold, ``live_sessions`` over ``backends``."""
        if math.isinf(self.epsilon):
            return math.inf
        mean = live_sessions / max(backends, 1)
        # Rounded down, so no backend holds more than (1 + epsilon) x the mean -- but always
        # one more than the mean rounded up: a backend one session over its share is not
        # overloaded, and moving a session there costs a prefix recompute for nothing (with
        # few sessions per backend, floor((1 + epsilon) x mean) alone would move sessions
        # whenever another one ends).
        return max(math.ceil(mean) + 1, math.floor((1 + self.epsilon) * mean + 1e-9))

    def _overfull(self, home: str, backends: Mapping[str, C], eligible: Eligible) -> bool:
        if math.isinf(self.epsilon):
            return False
        counts = self.sessions.live_sessions()
        members = [a for a in backends if eligible(a)]
        total = sum(counts[a] for a in members)
        return counts[home] > self.capacity(total, len(members))

    def _place(self, session_id: str, backends: Mapping[str, C], eligible: Eligible) -> C | None:
        candidates = [backends[a] for a in sorted(backends) if eligible(a)]
        if not candidates:
            return None
        counts = self.sessions.live_sessions()
        return min(
            candidates,
            key=lambda c: (
                counts[c.address],
                c.reported_load,
                stable_hash(f"{session_id}@{c.address}"),
            ),
        )


def make_policy(
    name: str, balancing: str = "least-outstanding", epsilon: float = DEFAULT_EPSILON
) -> PlacementPolicy:
    """The policy named ``name`` (``POLICIES``); ``balancing`` picks among backends for calls
    without a session ("least-outstanding" or "round-robin")."""
    if name == "bounded-load":
        return BoundedLoadPolicy(balancing=balancing, epsilon=epsilon)
    if name == "consistent-hash":
        return ConsistentHashPolicy(balancing=balancing)
    if name == "sticky-least-loaded":
        return BoundedLoadPolicy(balancing=balancing, epsilon=math.inf)
    raise ValueError(f"placement {name!r}: use one of {', '.join(POLICIES)}")
