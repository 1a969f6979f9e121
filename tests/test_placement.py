"""Where calls go (``servers.router.placement``): consistent hashing and load-aware choice,
without a network."""

from __future__ import annotations

import hashlib
import random
from collections import Counter

from servers.router.balancer import LeastOutstanding, RoundRobin
from servers.router.hash_ring import HashRing, stable_hash
from servers.router.placement import Placement

BACKENDS = [f"10.0.0.{i}:50051" for i in range(1, 5)]
SESSIONS = [f"session-{i}" for i in range(10_000)]


def owners(ring: HashRing, eligible=lambda _: True) -> dict[str, str | None]:  # type: ignore[no-untyped-def]
    return {s: ring.lookup(s, eligible) for s in SESSIONS}


def test_stable_hash_is_process_independent() -> None:
    # A fixed function of the bytes (not Python's per-process salted hash()).
    expected = int.from_bytes(hashlib.blake2b(b"session-1", digest_size=8).digest(), "big")
    assert stable_hash("session-1") == expected
    assert stable_hash("a") != stable_hash("b")


def test_sessions_spread_over_backends() -> None:
    counts = Counter(owners(HashRing(BACKENDS)).values())
    assert set(counts) == set(BACKENDS)
    assert all(0.17 < c / len(SESSIONS) < 0.33 for c in counts.values()), counts


def test_removing_a_backend_moves_only_its_sessions_and_readding_brings_them_back() -> None:
    ring = HashRing(BACKENDS)
    before = owners(ring)
    removed = BACKENDS[2]
    ring.remove(removed)
    after = owners(ring)
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert all(before[s] == removed for s in moved)  # 0 sessions of surviving backends moved
    assert all(after[s] != removed for s in SESSIONS)
    fraction = len(moved) / len(SESSIONS)
    print(f"moved fraction on removing 1 of 4 backends: {fraction:.4f}")
    assert 0.18 < fraction < 0.32
    ring.add(removed)
    assert owners(ring) == before


def test_ineligible_backend_sessions_fail_over_and_return() -> None:
    ring = HashRing(BACKENDS)
    before = owners(ring)
    down = BACKENDS[0]
    during = owners(ring, lambda b: b != down)
    for s in SESSIONS:
        if before[s] == down:
            assert during[s] not in (None, down)
        else:
            assert during[s] == before[s]
    assert owners(ring) == before
    assert ring.lookup("x", lambda _: False) is None
    assert HashRing().lookup("x") is None


def test_least_outstanding_picks_the_idlest_and_breaks_ties_randomly() -> None:
    load = {"a": 3, "b": 1, "c": 1, "d": 5}
    balancer = LeastOutstanding(random.Random(0))
    picks = Counter(balancer.pick(list(load), load.__getitem__) for _ in range(200))
    assert set(picks) == {"b", "c"} and min(picks.values()) > 60
    assert balancer.pick([], load.__getitem__) is None
    rr = RoundRobin()
    assert [rr.pick(["a", "b"], load.__getitem__) for _ in range(3)] == ["a", "b", "a"]


class View:
    """A backend as placement reads it."""

    def __init__(
        self, address: str, eligible: bool = True, in_flight: int = 0, paused: bool = False
    ) -> None:
        self.address = address
        self.eligible = eligible
        self.in_flight = in_flight
        self.paused = paused


def placed(backends: list[View]) -> tuple[Placement, dict[str, View]]:
    placement = Placement()
    for backend in backends:
        placement.add(backend.address)
    return placement, {b.address: b for b in backends}


def test_a_session_goes_to_its_ring_owner_and_follows_it_back() -> None:
    placement, backends = placed([View(a) for a in BACKENDS])
    ring = HashRing(BACKENDS)
    for session in SESSIONS[:200]:
        chosen = placement.choose(session, backends)
        assert chosen is not None and chosen.address == ring.lookup(session)
    session = SESSIONS[0]
    home = ring.lookup(session)
    assert home is not None
    backends[home].eligible = False  # unhealthy or draining
    moved = placement.choose(session, backends)
    assert moved is not None and moved.address != home
    backends[home].eligible = True
    back = placement.choose(session, backends)
    assert back is not None and back.address == home


def test_without_a_session_the_least_loaded_eligible_backend_is_chosen() -> None:
    views = [View(a, in_flight=n) for a, n in zip(BACKENDS, [5, 2, 0, 1], strict=True)]
    placement, backends = placed(views)
    assert placement.choose(None, backends) is views[2]
    views[2].eligible = False
    assert placement.choose(None, backends) is views[3]
    assert placement.choose(None, backends, exclude=frozenset({views[3].address})) is views[1]


def test_no_eligible_backend_means_no_choice() -> None:
    placement, backends = placed([View(a, eligible=False) for a in BACKENDS])
    assert placement.choose("s", backends) is None
    assert placement.choose(None, backends) is None
    placement, backends = placed([View(a) for a in BACKENDS])
    assert placement.choose("s", backends, exclude=frozenset(BACKENDS)) is None
    assert placement.choose(None, backends, exclude=frozenset(BACKENDS)) is None


def test_calls_without_a_session_avoid_paused_backends_while_one_runs() -> None:
    views = [View(a, in_flight=n) for a, n in zip(BACKENDS, [0, 3, 5, 9], strict=True)]
    placement, backends = placed(views)
    views[0].paused = views[1].paused = True
    assert placement.choose(None, backends) is views[2]  # busier, but not paused
    for view in views:
        view.paused = True
    assert placement.choose(None, backends) is views[0]  # all paused: the call waits there
    session_home = placement.choose("s-1", backends)
    views[1].paused = False
    assert placement.choose("s-1", backends) is session_home  # sessions keep their server
