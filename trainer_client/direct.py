"""Direct routing: the client places its generation calls itself and sends them straight to
the chosen engine server, skipping the router's hop (look-aside balancing, as gRPC calls it).

``DirectRoutes`` follows the router's routing view (``RouterAdmin.WatchBackends``: members,
their health, pause and load, the placement policy, where every session lives) and runs the
same policy classes as the router (``skyrl_grpc.placement``), so a session lands on the same
server whichever path its calls take. The router stays the authority: servers report the
sessions this client places to it, and its view comes back here.

If the router cannot be reached and the client was given the servers' addresses, it builds
the view from the servers themselves (each one's ``ServerStatus``: health, pause, load, weight
version, the sessions it holds) under the router's default placement, and keeps it fresh until
the router's feed is back: a trainer started while the router is down still generates. With
no servers known, or a router without the feed (an older one), calls go through the router,
and the log says so. If the feed drops after a view arrived (the router restarting), calls
keep going direct from the last view, and the feed reconnects on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from skyrl_grpc.errors import server_lost
from skyrl_grpc.placement import PlacementPolicy, make_policy
from skyrl_grpc.placement.policy import DEFAULT_EPSILON
from skyrl_grpc.sampling_seeds import ADVICE, reported_seed, shared_seeds
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc, status_pb2, status_pb2_grpc

log = logging.getLogger(__name__)

# A server a call just failed on is skipped this long (the feed may not have noticed yet).
UNAVAILABLE_SECONDS = 5.0
# How long the first call waits for the first view before going through the router.
FIRST_VIEW_SECONDS = 2.0
RECONNECT_SECONDS = (0.1, 2.0)  # first and longest wait between feed attempts
# The placement the router runs unless told otherwise (``servers.router`` ``--placement``):
# the one a view built from the servers runs.
DEFAULT_PLACEMENT = "bounded-load"
# How long one server gets to report its status for a view built from the servers.
STATUS_SECONDS = 2.0
# How long the router gets to list its members for a fleet-wide control call.
MEMBERS_SECONDS = 5.0


@dataclass
class Member:
    """A server as placement reads it, from the feed plus this client's own calls."""

    address: str
    eligible: bool = False
    paused: bool = False
    reported_load: int = 0
    in_flight: int = 0
    weight_version: int = 0
    sampling_seed: int | None = None  # None: the server reports none


class DirectRoutes:
    """The routing view of one event loop. ``finish_at(address, session)``: tells a server a
    session moved away from it (the router does the same for its own moves)."""

    def __init__(
        self,
        router_channel: grpc.aio.Channel,
        metadata: tuple[tuple[str, str], ...],
        finish_at: Callable[[str, str], None],
        servers: Sequence[str] = (),
        server_channel: Callable[[str], grpc.aio.Channel] | None = None,
    ) -> None:
        self._channel = router_channel
        self._metadata = metadata
        self._finish_at = finish_at
        # The servers this client was given, asked for their status while the router is away.
        self._servers = list(servers)
        self._server_channel = server_channel
        self.from_servers = False  # the view now is the servers' own (the router unreachable)
        # The members of the router's first view: a client given exactly those follows the
        # fleet's membership for its control calls (``fleet_now``).
        self.first_members: frozenset[str] | None = None
        # Of those, the ones serving (not standbys): a client given only those follows too.
        self.first_serving: frozenset[str] | None = None
        self.members: dict[str, Member] = {}
        self.policy: PlacementPolicy | None = None
        self._policy_key: tuple[str, float] | None = None
        self._homes: dict[str, str] = {}  # session -> server, as the feed last said
        self._unavailable: dict[str, float] = {}  # server -> until when it is skipped
        self.connected = False
        # Set once the feed answered: with a view, or with an error (then calls go through the
        # router at once instead of waiting for a view that may never come).
        self._first_answer = asyncio.Event()
        self._warned_fallback = False
        self._warned_seeds: set[tuple[int, tuple[str, ...]]] = set()
        self._task = asyncio.ensure_future(self._follow())

    # -- the feed -----------------------------------------------------------------------------

    async def _follow(self) -> None:
        wait = RECONNECT_SECONDS[0]
        while True:
            try:
                stub = router_pb2_grpc.RouterAdminStub(self._channel)
                call = stub.WatchBackends(
                    router_pb2.WatchBackendsRequest(), metadata=self._metadata
                )
                async for update in call:
                    # The router is back: its view (complete at first) replaces the servers'.
                    self.from_servers = False
                    self.apply(update)
                    if self.first_members is None:
                        self.first_members = frozenset(self.members)
                        self.first_serving = frozenset(
                            b.address for b in update.backends if not b.standby
                        )
                    if not self.connected:
                        self.connected = True
                        wait = RECONNECT_SECONDS[0]
                        log.info("direct routing: following the router's view")
                why = "the feed ended"
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as error:
                why = f"{error.code().name}: {error.details()}"
                if not self.connected and server_lost(error):
                    await self._view_from_servers()
            self._first_answer.set()
            if self.connected:
                log.warning(
                    "direct routing: the router's view is gone (%s); routing from the last "
                    "view until it is back",
                    why,
                )
            self.connected = False
            await asyncio.sleep(wait)
            wait = min(wait * 2, RECONNECT_SECONDS[1])

    async def _view_from_servers(self) -> None:
        """The view from the servers' own status, while the router cannot be reached (before
        any view from it: a last view of the router's is kept instead)."""
        if not self._servers or self._server_channel is None:
            return
        if self.policy is not None and not self.from_servers:
            return

        async def status(address: str) -> status_pb2.WatchResponse | None:
            assert self._server_channel is not None
            stub = status_pb2_grpc.ServerStatusStub(self._server_channel(address))
            call = stub.Watch(status_pb2.WatchRequest(), metadata=self._metadata)
            try:
                async for first in call:
                    return first
            except grpc.aio.AioRpcError:
                return None
            finally:
                call.cancel()
            return None

        async def bounded(address: str) -> status_pb2.WatchResponse | None:
            try:
                return await asyncio.wait_for(status(address), STATUS_SECONDS)
            except TimeoutError:
                return None

        statuses = await asyncio.gather(*(bounded(a) for a in self._servers))
        update = router_pb2.WatchBackendsResponse(placement=DEFAULT_PLACEMENT, complete=True)
        for address, reported in zip(self._servers, statuses, strict=True):
            healthy = reported is not None and not reported.draining
            update.backends.append(
                router_pb2.Backend(
                    address=address,
                    state=router_pb2.BACKEND_STATE_HEALTHY
                    if healthy
                    else router_pb2.BACKEND_STATE_UNHEALTHY,
                    paused=reported.paused if reported is not None else False,
                    weight_version=reported.weight_version if reported is not None else 0,
                    running_requests=reported.running_requests if reported is not None else 0,
                    waiting_requests=reported.waiting_requests if reported is not None else 0,
                    sampling_seed=reported_seed(reported) if reported is not None else None,
                )
            )
            if reported is not None:
                update.sessions_added.extend(
                    router_pb2.SessionPlacement(session_id=session, address=address)
                    for session in reported.sessions_added
                )
        if not self.from_servers:
            log.warning(
                "direct routing: the router cannot be reached; routing from the servers' own "
                "status until it is back"
            )
        self.from_servers = True
        self.apply(update)

    def apply(self, update: router_pb2.WatchBackendsResponse) -> None:
        """Takes one message of the feed."""
        epsilon = update.epsilon or DEFAULT_EPSILON
        key = (update.placement, epsilon)
        if self.policy is None or key != self._policy_key:
            self.policy = make_policy(update.placement, epsilon=epsilon)
            self.policy.on_move = lambda session, left, went: self._finish_at(left, session)
            self._policy_key = key
            self.members = {}
            self._homes = {}
        policy = self.policy
        listed = {b.address for b in update.backends}
        for gone in set(self.members) - listed:
            policy.remove(gone)
            del self.members[gone]
        for backend in update.backends:
            member = self.members.get(backend.address)
            if member is None:
                member = self.members[backend.address] = Member(backend.address)
                policy.add(backend.address)
            # A standby is kept current but given no calls.
            member.eligible = backend.state == router_pb2.BACKEND_STATE_HEALTHY
            member.eligible &= not backend.standby
            member.paused = backend.paused
            member.reported_load = backend.running_requests + backend.waiting_requests
            member.weight_version = backend.weight_version
            if backend.HasField("sampling_seed"):
                member.sampling_seed = backend.sampling_seed
        self._apply_sessions(update)
        self._warn_of_shared_seeds()
        self._first_answer.set()

    def _warn_of_shared_seeds(self) -> None:
        """Servers that report one sampling seed (``sampling_seeds``), once per such set: the
        router says the same in its log, which a trainer may never read."""
        seeds = {m.address: m.sampling_seed for m in self.members.values()}
        for seed, addresses in shared_seeds(seeds).items():
            if (seed, addresses) not in self._warned_seeds:
                self._warned_seeds.add((seed, addresses))
                log.warning(
                    "servers %s all sample with seed %d: %s", ", ".join(addresses), seed, ADVICE
                )

    def _apply_sessions(self, update: router_pb2.WatchBackendsResponse) -> None:
        assert self.policy is not None
        directory = self.policy.sessions
        if update.complete:
            by_server: dict[str, list[str]] = defaultdict(list)
            for placed in update.sessions_added:
                by_server[placed.address].append(placed.session_id)
            for address in self.members:
                directory.report(address, by_server.get(address, []), complete=True)
            self._homes = {p.session_id: p.address for p in update.sessions_added}
            return
        for session in update.sessions_removed:
            home = self._homes.pop(session, None)
            if home is not None:
                directory.report(home, [], [session])
        for placed in update.sessions_added:
            previous = self._homes.get(placed.session_id)
            if previous is not None and previous != placed.address:
                directory.report(previous, [], [placed.session_id])
            directory.report(placed.address, [placed.session_id])
            self._homes[placed.session_id] = placed.address

    # -- choosing -----------------------------------------------------------------------------

    async def fleet_now(self, given: Sequence[str]) -> list[str] | None:
        """The fleet as the router sees it now (servers moved, added or removed since), for a
        client given the router's whole fleet when its view first arrived (or all of it but
        its standbys); None otherwise (a client given some of the servers keeps to those). The
        given servers still in the fleet keep their order (a collective group's rank offsets
        follow it), new ones follow.

        Warm standbys are in it while they are healthy: a weight update reaches them in the
        same transaction. A standby that is down or still starting is left out, not waited
        for: it catches up from its peers before it serves, and a control call or a training
        step does not stall on a server that takes no traffic.

        The router is asked at the call (``ListBackends``), not only read from the feed: the
        feed lags while it reconnects (the router restarted), and a fleet-wide call planned on
        a stale view would miss a server that joined meanwhile (a weight update "committed"
        with that server left at the old version). Only a router that cannot be reached leaves
        the feed's last view to decide."""
        if self.first_members is None or self.from_servers:
            return None
        if frozenset(given) not in (self.first_members, self.first_serving):
            return None
        members = await self._router_members()
        if members is None:
            members = set(self.members)
        kept = [address for address in given if address in members]
        return kept + sorted(members.difference(kept))

    async def _router_members(self) -> set[str] | None:
        """The router's members now, but standbys that are not healthy; None if it does not
        answer in time."""
        stub = router_pb2_grpc.RouterAdminStub(self._channel)
        try:
            listed = await stub.ListBackends(
                router_pb2.ListBackendsRequest(), metadata=self._metadata, timeout=MEMBERS_SECONDS
            )
        except grpc.aio.AioRpcError as error:
            log.warning(
                "the router did not list its servers (%s: %s); control calls go to its last view's",
                error.code().name,
                error.details(),
            )
            return None
        return {
            backend.address
            for backend in listed.backends
            if not backend.standby or backend.state == router_pb2.BACKEND_STATE_HEALTHY
        }

    async def ready(self) -> bool:
        """Whether calls can go direct: a view has arrived (waiting a little for the first)."""
        if self.policy is None:
            try:
                await asyncio.wait_for(self._first_answer.wait(), FIRST_VIEW_SECONDS)
            except TimeoutError:
                pass
            if self.policy is None:
                if not self._warned_fallback:
                    self._warned_fallback = True
                    log.warning(
                        "direct routing: no view from the router's WatchBackends; calls go "
                        "through the router until one arrives"
                    )
                return False
        return True

    def pick(
        self, session_id: str | None, tried: Iterable[str] = (), min_version: int = 0
    ) -> str | None:
        """The server for a call (serving ``min_version`` or newer), or None when none is
        eligible (or there is no view): the call then goes through the router."""
        if self.policy is None:
            return None
        now = time.monotonic()
        skipped = frozenset({a for a, until in self._unavailable.items() if until > now})
        chosen = self.policy.choose(
            session_id, self.members, skipped | frozenset(tried), min_version
        )
        return None if chosen is None else chosen.address

    def begin(self, address: str) -> None:
        member = self.members.get(address)
        if member is not None:
            member.in_flight += 1

    def end(self, address: str) -> None:
        member = self.members.get(address)
        if member is not None:
            member.in_flight -= 1

    def mark_unavailable(self, address: str) -> None:
        self._unavailable[address] = time.monotonic() + UNAVAILABLE_SECONDS

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
