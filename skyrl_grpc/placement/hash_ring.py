"""Consistent hashing with virtual nodes: which backend owns a session.

Each backend owns ``replicas`` points on a 64-bit ring; a session id hashes to a point and belongs
to the first backend clockwise from it. Adding or removing a backend moves only the sessions
whose owner changes (about 1/N of them); sessions of the other backends stay put. A lookup may
skip backends that are not eligible (unhealthy, draining): their sessions go to the next backend
on the ring and come back when the backend is eligible again, while nobody else's move.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterable


def stable_hash(key: str) -> int:
    """A 64-bit hash that is the same in every process (unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """The ring of backend addresses. Not thread-safe; the router uses it from one event loop."""

    def __init__(self, members: Iterable[str] = (), replicas: int = 160) -> None:
        self.replicas = replicas
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: set[str] = set()
        for member in members:
            self.add(member)

    def add(self, member: str) -> None:
        if member in self._members:
            return
        self._members.add(member)
        for replica in range(self.replicas):
            point = stable_hash(f"{member}#{replica}")
            index = bisect.bisect(self._points, point)
            self._points.insert(index, point)
            self._owners.insert(index, member)

    def remove(self, member: str) -> None:
        if member not in self._members:
            return
        self._members.discard(member)
        kept = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != member]
        self._points = [p for p, _ in kept]
        self._owners = [o for _, o in kept]

    def lookup(self, key: str, eligible: Callable[[str], bool] = lambda _: True) -> str | None:
        """The first eligible backend clockwise from ``key``'s point; None if none is eligible."""
        if not self._points:
            return None
        start = bisect.bisect(self._points, stable_hash(key))
        count = len(self._points)
        seen: set[str] = set()
        for step in range(count):
            owner = self._owners[(start + step) % count]
            if owner in seen:
                continue
            if eligible(owner):
                return owner
            seen.add(owner)
            if len(seen) == len(self._members):
                break
        return None
