"""Where calls go (``skyrl_grpc.placement``): consistent hashing, bounded-load placement of
sessions, the session directory and load-aware choice, without a network."""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from typing import TypeVar

import pytest

from skyrl_grpc.placement import (
    BoundedLoadPolicy,
    ConsistentHashPolicy,
    PlacementPolicy,
    SessionDirectory,
    make_policy,
)
from skyrl_grpc.placement.balancer import LeastOutstanding, RoundRobin
from skyrl_grpc.placement.hash_ring import HashRing, stable_hash
from skyrl_grpc.placement.policy import behind

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
        self,
        address: str,
        eligible: bool = True,
        in_flight: int = 0,
        paused: bool = False,
        reported_load: int = 0,
        weight_version: int = 0,
    ) -> None:
        self.address = address
        self.eligible = eligible
        self.in_flight = in_flight
        self.paused = paused
        self.reported_load = reported_load
        self.weight_version = weight_version


Policy = TypeVar("Policy", bound=PlacementPolicy)


def placed(backends: list[View], policy: Policy) -> tuple[Policy, dict[str, View]]:
    for backend in backends:
        policy.add(backend.address)
    return policy, {b.address: b for b in backends}


def test_a_session_goes_to_its_ring_owner_and_follows_it_back() -> None:
    ring = HashRing(BACKENDS)
    for session in SESSIONS[:200]:
        policy, backends = placed([View(a) for a in BACKENDS], ConsistentHashPolicy())
        chosen = policy.choose(session, backends)
        assert chosen is not None and chosen.address == ring.lookup(session)
    session = SESSIONS[0]
    home = ring.lookup(session)
    assert home is not None
    policy, backends = placed([View(a) for a in BACKENDS], ConsistentHashPolicy())
    assert policy.choose(session, backends) is backends[home]
    backends[home].eligible = False  # unhealthy or draining
    moved = policy.choose(session, backends)
    assert moved is not None and moved.address != home
    backends[home].eligible = True
    back = policy.choose(session, backends)
    assert back is not None and back.address == home


def test_without_a_session_the_least_loaded_eligible_backend_is_chosen() -> None:
    views = [View(a, in_flight=n) for a, n in zip(BACKENDS, [5, 2, 0, 1], strict=True)]
    policy, backends = placed(views, ConsistentHashPolicy())
    assert policy.choose(None, backends) is views[2]
    views[2].eligible = False
    assert policy.choose(None, backends) is views[3]
    assert policy.choose(None, backends, exclude=frozenset({views[3].address})) is views[1]


def test_no_eligible_backend_means_no_choice() -> None:
    for policy in (ConsistentHashPolicy(), BoundedLoadPolicy()):
        policy, backends = placed([View(a, eligible=False) for a in BACKENDS], policy)
        assert policy.choose("s", backends) is None
        assert policy.choose(None, backends) is None
        for view in backends.values():
            view.eligible = True
        assert policy.choose("s", backends, exclude=frozenset(BACKENDS)) is None
        assert policy.choose(None, backends, exclude=frozenset(BACKENDS)) is None


def test_calls_without_a_session_avoid_paused_backends_while_one_runs() -> None:
    views = [View(a, in_flight=n) for a, n in zip(BACKENDS, [0, 3, 5, 9], strict=True)]
    policy, backends = placed(views, ConsistentHashPolicy())
    views[0].paused = views[1].paused = True
    assert policy.choose(None, backends) is views[2]  # busier, but not paused
    for view in views:
        view.paused = True
    assert policy.choose(None, backends) is views[0]  # all paused: the call waits there
    session_home = policy.choose("s-1", backends)
    views[1].paused = False
    assert policy.choose("s-1", backends) is session_home  # sessions keep their server


# -- bounded-load placement ----------------------------------------------------------------------


def test_new_sessions_go_to_the_least_loaded_server_and_stay() -> None:
    policy, backends = placed([View(a) for a in BACKENDS], BoundedLoadPolicy())
    homes = {}
    for i in range(40):
        chosen = policy.choose(f"s{i}", backends)
        assert chosen is not None
        homes[f"s{i}"] = chosen.address
    assert sorted(Counter(homes.values()).values()) == [10, 10, 10, 10]
    for _ in range(3):  # every later turn lands where the session lives
        for session, home in homes.items():
            assert policy.choose(session, backends).address == home  # type: ignore[union-attr]
    # Load the servers report breaks ties between equally filled servers.
    backends[BACKENDS[0]].reported_load = 50
    assert policy.choose("s-new", backends).address != BACKENDS[0]  # type: ignore[union-attr]


def test_bounded_load_holds_under_arrivals_and_departures() -> None:
    """Sessions arrive, take turns and end unevenly (long ones stay long, and once all of
    one server's end together): no turn ever runs on a server past the bound, and the fleet
    is back within it once the excess sessions have taken their next turn."""
    policy = BoundedLoadPolicy(epsilon=0.25)
    policy, backends = placed([View(a) for a in BACKENDS], policy)
    moves: list[tuple[str, str, str]] = []
    policy.on_move = lambda session, left, went: moves.append((session, left, went))
    rng = random.Random(7)
    live: list[str] = []
    worst = 0.0
    for step in range(20_000):
        roll = rng.random() if step >= 200 else 1.0  # 200 sessions arrive first
        if step == 10_000:  # every session of one server ends at once (one long batch done)
            for session in [s for s in live if policy.sessions.home(s) == BACKENDS[0]]:
                live.remove(session)
                policy.sessions.finish(session)
        if live and roll < 0.25:  # a session ends: recent ones more often
            session = live.pop(len(live) - 1 - min(int(rng.expovariate(1 / 3)), len(live) - 1))
            policy.sessions.finish(session)
            continue
        session = rng.choice(live) if live and roll < 0.75 else f"n{step}"
        chosen = policy.choose(session, backends)
        assert chosen is not None
        if session not in live:
            live.append(session)
        counts = policy.sessions.live_sessions()
        assert counts[chosen.address] <= policy.capacity(len(live), len(BACKENDS))
        mean = len(live) / len(BACKENDS)
        if mean >= 20 and not 10_000 <= step < 12_000:  # the excess moves turn by turn
            worst = max(worst, max(counts.values()) / mean)
    assert 1.0 < worst <= 1.25, worst
    assert moves and all(left != went for _, left, went in moves)
    assert len(moves) < 0.05 * 20_000  # balance costs few moves


def test_a_server_that_leaves_moves_only_its_sessions_and_one_that_joins_takes_new_ones() -> None:
    policy, backends = placed([View(a) for a in BACKENDS[:3]], BoundedLoadPolicy())
    homes = {f"s{i}": policy.choose(f"s{i}", backends).address for i in range(30)}  # type: ignore[union-attr]
    gone = BACKENDS[0]
    policy.remove(gone)
    del backends[gone]
    after = {s: policy.choose(s, backends).address for s in homes}  # type: ignore[union-attr]
    for session, home in homes.items():
        if home != gone:
            assert after[session] == home  # nobody else's session moved
        else:
            assert after[session] != gone
    joined = View(BACKENDS[3])
    policy.add(joined.address)
    backends[joined.address] = joined
    newcomers = [policy.choose(f"new{i}", backends).address for i in range(8)]  # type: ignore[union-attr]
    assert newcomers == [joined.address] * 8  # it holds none: it takes new sessions first
    assert {s: policy.choose(s, backends).address for s in after} == after  # type: ignore[union-attr]


def test_a_joined_server_takes_the_excess_of_overfull_ones_and_nothing_more() -> None:
    policy, backends = placed([View(a) for a in BACKENDS[:3]], BoundedLoadPolicy(epsilon=0.25))
    moves: list[tuple[str, str, str]] = []
    policy.on_move = lambda session, left, went: moves.append((session, left, went))
    sessions = [f"s{i}" for i in range(60)]
    for session in sessions:
        policy.choose(session, backends)
    assert sorted(policy.sessions.live_sessions().values()) == [20, 20, 20]
    joined = View(BACKENDS[3])
    policy.add(joined.address)
    backends[joined.address] = joined
    for _ in range(3):  # every session takes three more turns
        for session in sessions:
            policy.choose(session, backends)
    # Mean 15, bound floor(1.25 * 15) = 18: two sessions of each full server moved, to the
    # new one, once.
    assert sorted(policy.sessions.live_sessions().values()) == [6, 18, 18, 18]
    assert sorted(left for _, left, _ in moves) == sorted(BACKENDS[:3] * 2)
    assert {went for _, _, went in moves} == {joined.address}
    assert len({s for s, _, _ in moves}) == 6


def test_two_independent_policies_place_unseen_sessions_identically() -> None:
    """Two router replicas (or a router and a client routing itself) shown the same servers
    and the same reports place every new session the same way, with nothing shared."""

    def replica() -> tuple[PlacementPolicy, dict[str, View]]:
        policy, backends = placed(
            [View(a, reported_load=n) for a, n in zip(BACKENDS, [3, 0, 3, 1], strict=True)],
            BoundedLoadPolicy(),
        )
        policy.sessions.report(BACKENDS[0], [f"old{i}" for i in range(5)], complete=True)
        policy.sessions.report(BACKENDS[1], [f"old{i}" for i in range(5, 7)], complete=True)
        return policy, backends

    first, first_backends = replica()
    second, second_backends = replica()
    for i in range(100):
        a = first.choose(f"unseen-{i}", first_backends)
        b = second.choose(f"unseen-{i}", second_backends)
        assert a is not None and b is not None and a.address == b.address
    # A replica that never saw a session finds it where the server reports it.
    third, third_backends = replica()
    third.sessions.report(BACKENDS[3], ["moved-session"])
    assert third.choose("moved-session", third_backends).address == BACKENDS[3]  # type: ignore[union-attr]


# -- the session directory -----------------------------------------------------------------------


def test_reports_override_placements_and_a_complete_report_resets_a_server() -> None:
    now = [0.0]
    directory = SessionDirectory(pending_seconds=10, clock=lambda: now[0])
    directory.place("a", "x:1")
    assert directory.home("a") == "x:1"
    directory.report("y:1", ["a", "b"])  # the servers know better
    assert directory.home("a") == "y:1" and directory.home("b") == "y:1"
    directory.report("y:1", ["c"], complete=True)  # all it holds now
    assert directory.home("a") is None and directory.home("c") == "y:1"
    directory.report("y:1", [], removed=["c"])
    assert directory.home("c") is None
    directory.place("d", "x:1")
    now[0] = 11  # a placement its server never reported does not count forever
    assert directory.home("d") is None and directory.live_sessions() == Counter()
    directory.place("e", "x:1")
    now[0] = 20
    directory.touch("e")  # used again: lives on
    now[0] = 29
    assert directory.home("e") == "x:1"
    directory.report("z:1", ["f", "g"])
    directory.forget_server("z:1")
    assert directory.home("f") is None
    directory.report("z:1", ["h"])
    directory.finish("h")
    assert directory.home("h") is None and len(directory) == 1


def test_policies_are_named() -> None:
    assert isinstance(make_policy("bounded-load"), BoundedLoadPolicy)
    assert isinstance(make_policy("consistent-hash"), ConsistentHashPolicy)
    with pytest.raises(ValueError, match="bounded-load"):
        make_policy("random")


@pytest.mark.parametrize("policy", ["bounded-load", "consistent-hash", "sticky-least-loaded"])
def test_a_backend_behind_the_fleets_weights_gets_no_calls_until_it_catches_up(
    policy: str,
) -> None:
    # "c" came back (or was added) serving version 0 while the others serve 3.
    views = [View("a", weight_version=3), View("b", weight_version=3), View("c")]
    chosen, backends = placed(views, make_policy(policy))
    assert behind(backends) == {"c"}
    picks = {chosen.choose(f"s{i}", backends).address for i in range(40)}  # type: ignore[union-attr]
    picks |= {chosen.choose(None, backends).address for _ in range(5)}  # type: ignore[union-attr]
    assert picks == {"a", "b"}
    # An ineligible backend does not count: with only "c" healthy, it serves...
    views[0].eligible = views[1].eligible = False
    assert chosen.choose("alone", backends).address == "c"  # type: ignore[union-attr]
    # ... but never a continuation of tokens made at 3: a sample's versions never go back.
    assert behind(backends, min_version=3) == {"c"}
    assert chosen.choose("alone", backends, min_version=3) is None
    assert chosen.choose(None, backends, min_version=3) is None
    assert chosen.choose(None, backends, min_version=0).address == "c"  # type: ignore[union-attr]
    # Caught up: it takes calls again.
    views[0].eligible = views[1].eligible = True
    views[2].weight_version = 3
    assert behind(backends) == frozenset()
    assert "c" in {chosen.choose(f"t{i}", backends).address for i in range(40)}  # type: ignore[union-attr]
    assert behind(backends, min_version=4) == {"a", "b", "c"}  # none made those weights yet
