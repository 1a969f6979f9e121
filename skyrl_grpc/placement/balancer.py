"""Load-aware choice of a backend for calls without a session: least outstanding requests.

With the handful of backends a router fronts, looking at every in-flight count is as cheap as
sampling two (power of two choices) and strictly better; ties are broken at random so equal
backends share the load instead of the first one taking every burst.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class LeastOutstanding:
    """Picks the candidate with the fewest in-flight calls."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[T], in_flight: Callable[[T], int]) -> T | None:
        if not candidates:
            return None
        fewest = min(in_flight(c) for c in candidates)
        tied = [c for c in candidates if in_flight(c) == fewest]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


class RoundRobin:
    """Rotates through candidates regardless of load (the baseline the benchmark compares to)."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[T], in_flight: Callable[[T], int]) -> T | None:
        if not candidates:
            return None
        choice = candidates[self._next % len(candidates)]
        self._next += 1
        return choice
