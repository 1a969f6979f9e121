"""Warm standbys: servers a fleet keeps current but gives no traffic, promoted when a serving
server dies.

A standby is a member of the router like any server: health-watched, and reached by the
trainer's control calls and weight updates (in the relay, in the same transaction), so it
serves the fleet's version at every step. The router marks it standby (RouterAdmin
SetStandby), so no data-plane call goes to it. When a serving server dies, a healthy standby at
the fleet's newest version is made serving and the dead server a standby: by the router, which
sees the death first (``servers.router.backends``), or else by the supervisor, which calls
``promote_in_place_of`` at once; the supervisor then restarts the dead one as it always
does, and it comes back as the fleet's new standby (caught up from its peers before it
serves). The fleet is at full capacity as soon as the router has the promotion, not when the
restart is done. Roles are kept by server index, so a server that comes back on another
address (Ray) keeps its role.

Plain callables in (the router's members, setting a role), so fleets share it and tests drive
it without a router.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from skyrl_grpc.v1 import router_pb2

Members = Callable[[], Sequence[router_pb2.Backend]]
SetStandby = Callable[[str, bool], None]


class StandbyRoles:
    """Which of a fleet's servers, by index, are warm standbys."""

    def __init__(self, indexes: set[int] | None = None) -> None:
        self.indexes: set[int] = set(indexes or ())

    @classmethod
    def last(cls, standby: int, total: int) -> StandbyRoles:
        """The last ``standby`` of ``total`` servers are the standbys (a fleet's start)."""
        if standby < 0 or standby >= total:
            raise ValueError(f"{standby} standbys of {total} servers: at least one must serve")
        return cls(set(range(total - standby, total)))

    def of(self, addresses: Sequence[str]) -> tuple[str, ...]:
        """The standbys' addresses, in index order."""
        return tuple(a for i, a in enumerate(addresses) if i in self.indexes)

    def promote_in_place_of(
        self, dead: int, addresses: Sequence[str], members: Members, set_standby: SetStandby
    ) -> int | None:
        """Server ``dead`` died: makes a healthy standby that is not behind serving and
        ``dead`` a standby; returns the promoted one's index (None: ``dead`` was a standby
        itself, or no standby is ready, and ``dead`` comes back serving, as without any).
        The router may have done it already (it sees a death first: ``BackendPool``); then
        its roles are taken as they are."""
        if dead in self.indexes or not self.indexes:
            return None
        listed = {b.address: b for b in members()}
        seen = listed.get(addresses[dead])
        if seen is not None and seen.standby:  # the router promoted one already
            before = set(self.indexes)
            self.indexes = {i for i, a in enumerate(addresses) if a in listed and listed[a].standby}
            return next(iter(sorted(before - self.indexes)), None)
        healthy = {
            b.address: b.weight_version
            for b in listed.values()
            if b.state == router_pb2.BACKEND_STATE_HEALTHY and b.address != addresses[dead]
        }
        newest = max(healthy.values(), default=0)
        for index in sorted(self.indexes):
            if healthy.get(addresses[index]) == newest:
                set_standby(addresses[index], False)
                set_standby(addresses[dead], True)
                self.indexes.discard(index)
                self.indexes.add(dead)
                return index
        return None

    def before_removing(self, last: int, addresses: Sequence[str], set_standby: SetStandby) -> None:
        """The fleet shrinks by removing server ``last`` (the newest): where that is a standby,
        the newest serving server becomes a standby in its place first, so the fleet keeps its
        standbys and serves one server fewer."""
        if last not in self.indexes:
            return
        serving = [i for i in range(len(addresses)) if i not in self.indexes]
        if len(serving) < 2:
            raise ValueError("scale: a fleet keeps at least one serving server")
        demoted = serving[-1]
        set_standby(addresses[demoted], True)
        self.indexes.discard(last)
        self.indexes.add(demoted)
