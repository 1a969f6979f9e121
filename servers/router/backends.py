"""The router's backends: membership, health and load.

Each backend is watched with ``grpc.health.v1`` Watch on the DataPlane service: a backend that
reports NOT_SERVING (draining), or whose connection drops (killed), is ejected at once, and
re-admitted when a new Watch sees SERVING. A forwarded call that fails UNAVAILABLE ejects the
backend passively and restarts its watch, so a recovered backend comes back on its own.

``BackendPool.choose`` asks ``placement`` where a call goes (a session's backend as the policy
places it, anything else the least-loaded eligible backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servers.common.tasks import BackgroundTasks
from skyrl_grpc.channels import open_channel
from skyrl_grpc.errors import AlreadyExists, NotFound
from skyrl_grpc.names import DATA_PLANE
from skyrl_grpc.placement import make_policy
from skyrl_grpc.sampling_seeds import ADVICE, reported_seed, shared_seeds
from skyrl_grpc.session_moves import finish_moved_session
from skyrl_grpc.v1 import (
    router_pb2,
    status_pb2,
    status_pb2_grpc,
)

log = logging.getLogger(__name__)

HEALTHY = router_pb2.BACKEND_STATE_HEALTHY
UNHEALTHY = router_pb2.BACKEND_STATE_UNHEALTHY
DRAINING = router_pb2.BACKEND_STATE_DRAINING
UNKNOWN = router_pb2.BACKEND_STATE_UNSPECIFIED


@dataclass(eq=False)
class Backend:
    """One engine server as the router sees it."""

    address: str
    channel: grpc.aio.Channel
    state: router_pb2.BackendState = UNKNOWN
    in_flight: int = 0
    total_requests: int = 0
    failed_requests: int = 0
    watch_task: asyncio.Task[None] | None = None
    watch_call: (
        grpc.aio.UnaryStreamCall[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]
        | None
    ) = None
    recheck_requested: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    status_task: asyncio.Task[None] | None = None
    # What the backend last reported of itself (ServerStatus); default until it does.
    status: status_pb2.WatchResponse = field(default_factory=status_pb2.WatchResponse)
    # A warm standby: watched and listed (control calls reach it), given no data-plane calls.
    standby: bool = False

    @property
    def healthy(self) -> bool:
        return self.state == HEALTHY

    @property
    def eligible(self) -> bool:
        """Whether data-plane calls may go to it: healthy and serving (not a standby)."""
        return self.healthy and not self.standby

    @property
    def state_name(self) -> str:
        """The state as people read it: healthy, unhealthy, draining, unspecified."""
        return router_pb2.BackendState.Name(self.state).removeprefix("BACKEND_STATE_").lower()

    @property
    def paused(self) -> bool:
        return self.status.paused

    @property
    def weight_version(self) -> int:
        return int(self.status.weight_version)

    @property
    def reported_load(self) -> int:
        return self.status.running_requests + self.status.waiting_requests

    def to_proto(self, live_sessions: int) -> router_pb2.Backend:
        return router_pb2.Backend(
            address=self.address,
            state=self.state,
            in_flight=self.in_flight,
            total_requests=self.total_requests,
            failed_requests=self.failed_requests,
            paused=self.status.paused,
            weight_version=self.status.weight_version,
            running_requests=self.status.running_requests,
            waiting_requests=self.status.waiting_requests,
            live_sessions=live_sessions,
            prompt_tokens=self.status.prompt_tokens,
            cached_prompt_tokens=self.status.cached_prompt_tokens,
            standby=self.standby,
            sampling_seed=reported_seed(self.status),
        )


ChannelFactory = Callable[[str], grpc.aio.Channel]


class BackendPool:
    """Backends, their health watches, and the routing decision."""

    def __init__(
        self,
        addresses: Iterable[str] = (),
        *,
        standbys: Iterable[str] = (),
        check_interval: float = 1.0,
        channel_factory: ChannelFactory = open_channel,
        balancing: str = "least-outstanding",
        placement: str = "bounded-load",
        on_change: Callable[[Backend], None] | None = None,
    ) -> None:
        # Told (promoted, lost) when a standby took a lost server's place (``_replace_lost``).
        self.on_promoted: Callable[[str, str], object] = lambda promoted, lost: None
        self.check_interval = check_interval
        self._channel_factory = channel_factory
        self._backends: dict[str, Backend] = {}
        self.placement = make_policy(placement, balancing)
        self.placement.on_move = self._session_moved
        self._on_change = on_change
        self._initial_standbys = set(standbys)
        # Standbys are members too, listed in ``addresses`` or not.
        self._initial = list(addresses)
        self._initial += [a for a in standbys if a not in self._initial]
        self._tasks = BackgroundTasks()
        # Set at every change of a member (``_changed``): what ``until_serving`` waits on.
        self._some_change = asyncio.Event()

    # -- membership ---------------------------------------------------------------------------

    async def start(self, members: list[tuple[str, bool]] | None = None) -> None:
        """Starts watching the initial backends (``members``, where given: the membership
        another replica has now, as (address, standby))."""
        if members is None:
            members = [(a, a in self._initial_standbys) for a in self._initial]
        for address, standby in members:
            self.add(address, standby=standby)

    def add(self, address: str, *, standby: bool = False) -> Backend:
        if address in self._backends:
            raise AlreadyExists(f"backend {address} is already a member")
        backend = Backend(address, self._channel_factory(address), standby=standby)
        backend.idle.set()
        self._backends[address] = backend
        self.placement.add(address)
        backend.watch_task = self._tasks.spawn(self._watch(backend), name=f"watch {address}")
        backend.status_task = self._tasks.spawn(
            self._watch_status(backend), name=f"status {address}"
        )
        log.info("backend %s added%s", address, " as a standby" if standby else "")
        return backend

    def set_standby(self, address: str, standby: bool) -> Backend:
        """Makes a member a standby (no new data-plane calls) or a serving member."""
        backend = self.get(address)
        if backend.standby != standby:
            backend.standby = standby
            log.info("backend %s is %s", address, "a standby" if standby else "serving")
            self._changed(backend)
        return backend

    async def remove(self, address: str) -> None:
        backend = self.get(address)
        del self._backends[address]
        self.placement.remove(address)
        watches = [t for t in (backend.watch_task, backend.status_task) if t is not None]
        for task in watches:
            task.cancel()
        # Their CancelledError is their result here; a cancellation of remove() itself
        # still propagates (suppressing CancelledError around ``await task`` would eat it).
        await asyncio.gather(*watches, return_exceptions=True)
        backend.state = UNKNOWN
        self._changed(backend)
        # In-flight calls keep their own references and finish; close the channel after them.
        self._tasks.spawn(self._close_when_idle(backend), name=f"close {address}")
        log.info("backend %s removed", address)

    async def drain(self, address: str, timeout: float | None) -> int:
        """No new calls to the backend; waits for its in-flight calls, then removes it."""
        backend = self.get(address)
        backend.state = DRAINING
        self._changed(backend)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(backend.idle.wait(), timeout)
        remaining = backend.in_flight
        await self.remove(address)
        return remaining

    async def _close_when_idle(self, backend: Backend) -> None:
        await backend.idle.wait()
        await backend.channel.close()

    def get(self, address: str) -> Backend:
        try:
            return self._backends[address]
        except KeyError:
            raise NotFound(f"backend {address} is not a member (see ListBackends)") from None

    @property
    def backends(self) -> list[Backend]:
        return [self._backends[a] for a in sorted(self._backends)]

    def describe(self, backends: Iterable[Backend] | None = None) -> list[router_pb2.Backend]:
        """``backends`` (default: all) as ListBackends reports them."""
        sessions = self.placement.sessions.live_sessions()
        chosen = self.backends if backends is None else backends
        return [b.to_proto(sessions[b.address]) for b in chosen]

    def healthy(self) -> list[Backend]:
        """Members passing health checks, standbys too."""
        return [b for b in self.backends if b.healthy]

    def serving(self, min_version: int = 0) -> list[Backend]:
        """Members data-plane calls may go to: healthy, not standbys (and serving weight
        ``min_version`` or newer)."""
        return [b for b in self.backends if b.eligible and b.weight_version >= min_version]

    # -- routing ------------------------------------------------------------------------------

    def choose(
        self, session_id: str | None, exclude: frozenset[str] = frozenset(), min_version: int = 0
    ) -> Backend | None:
        """The backend for a call (see ``placement``: never one that is behind, nor older than
        ``min_version``)."""
        return self.placement.choose(session_id, self._backends, exclude, min_version)

    def owner(self, session_id: str) -> str | None:
        """Which backend a session maps to now (for tests and debugging); a session that lives
        nowhere yet is placed, as its first call would be."""
        backend = self.placement.choose(session_id, self._backends)
        return None if backend is None else backend.address

    def begin(self, backend: Backend) -> None:
        backend.in_flight += 1
        backend.total_requests += 1
        backend.idle.clear()

    def end(self, backend: Backend, failed: bool) -> None:
        backend.in_flight -= 1
        if failed:
            backend.failed_requests += 1
        if backend.in_flight == 0:
            backend.idle.set()

    # -- health -------------------------------------------------------------------------------

    def mark_unavailable(self, backend: Backend) -> None:
        """Passive ejection after a call failed UNAVAILABLE; the watch re-checks it."""
        if backend.state == DRAINING or backend.address not in self._backends:
            return
        if backend.state != UNHEALTHY:
            log.warning("backend %s ejected: a call failed UNAVAILABLE", backend.address)
        self._set_state(backend, UNHEALTHY)
        if backend.watch_call is not None:
            backend.recheck_requested = True
            backend.watch_call.cancel()

    def _set_state(self, backend: Backend, state: router_pb2.BackendState) -> None:
        if backend.state == DRAINING or backend.state == state:
            return
        lost = backend.eligible and state != HEALTHY
        backend.state = state
        log.info("backend %s is %s", backend.address, router_pb2.BackendState.Name(state))
        if lost:
            self._replace_lost(backend)
        self._changed(backend)

    def _replace_lost(self, lost: Backend) -> None:
        """A serving member was lost: a healthy standby that is not behind takes its place at
        once (before the call that found it gone is retried), and the lost one becomes a
        standby: kept current, serving again only when promoted. The first to see a death is
        this router (the connection drops), so no call finds the fleet a server short."""
        members = self.backends
        newest = max((b.weight_version for b in members if b.healthy), default=0)
        ready = [b for b in members if b.standby and b.healthy and b.weight_version >= newest]
        if not ready or lost.address not in self._backends:
            return
        promoted = ready[0]
        promoted.standby, lost.standby = False, True
        log.warning(
            "backend %s lost: standby %s serves in its place", lost.address, promoted.address
        )
        self._changed(promoted)
        self.on_promoted(promoted.address, lost.address)

    def _changed(self, backend: Backend) -> None:
        self._some_change.set()
        if self._on_change is not None:
            self._on_change(backend)

    async def until_serving(self, seconds: float, min_version: int = 0) -> bool:
        """Whether a member takes data-plane calls (``serving``, at ``min_version`` or newer)
        now, or within ``seconds``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not self.serving(min_version):
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._some_change.clear()  # no await since the look: no change missed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._some_change.wait(), left)
        return True

    async def _watch(self, backend: Backend) -> None:
        stub = health_pb2_grpc.HealthStub(backend.channel)
        request = health_pb2.HealthCheckRequest(service=DATA_PLANE)
        while True:
            try:
                backend.watch_call = stub.Watch(request)
                async for response in backend.watch_call:
                    serving = response.status == health_pb2.HealthCheckResponse.SERVING
                    self._set_state(backend, HEALTHY if serving else UNHEALTHY)
            except grpc.aio.AioRpcError as error:
                log.debug("health watch of %s ended: %s", backend.address, error.code())
            except asyncio.CancelledError:
                # Two cancellations end up here: of the watch call (``mark_unavailable`` asks
                # for a fresh look) and of this task (``remove``); the task's own wins, even
                # when a recheck was asked for just before, or ``remove`` waits forever.
                task = asyncio.current_task()
                if not backend.recheck_requested or (task is not None and task.cancelling()):
                    raise
                backend.recheck_requested = False
            self._set_state(backend, UNHEALTHY)
            await self._until_worth_watching(backend)

    async def _until_worth_watching(self, backend: Backend) -> None:
        """Until its channel reconnects (a server healed from a partition is watched again,
        and routed to, at once), or ``check_interval`` at the latest; a watch that ended on a
        connected channel waits the whole interval (no loop of calls a server refuses)."""
        if backend.channel.get_state() == grpc.ChannelConnectivity.READY:
            await asyncio.sleep(self.check_interval)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(backend.channel.channel_ready(), self.check_interval)

    async def _watch_status(self, backend: Backend) -> None:
        """Follows the backend's ServerStatus (pause, weight version, load); a server without
        the service (an older one) is simply not followed."""
        stub = status_pb2_grpc.ServerStatusStub(backend.channel)
        request = status_pb2.WatchRequest(interval_ms=round(self.check_interval * 1000))
        sessions = self.placement.sessions
        while True:
            try:
                async for status in stub.Watch(request):
                    changed = status.paused != backend.status.paused
                    seeded = status.HasField("sampling_seed") and (
                        status.sampling_seed != backend.status.sampling_seed
                        or not backend.status.HasField("sampling_seed")
                    )
                    backend.status = status
                    if seeded:
                        self._warn_of_a_shared_seed(backend)
                    sessions.report(
                        backend.address,
                        status.sessions_added,
                        status.sessions_removed,
                        status.sessions_complete,
                    )
                    if changed:
                        state = "paused" if status.paused else "resumed"
                        log.info("backend %s %s", backend.address, state)
                    self._changed(backend)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return
                log.debug("status watch of %s ended: %s", backend.address, error.code())
            # Its sessions stay where they are: while it is unhealthy placement moves each on
            # its next turn, and a reconnect reports them all again.
            backend.status = status_pb2.WatchResponse()  # unknown until it reports again
            await asyncio.sleep(self.check_interval)

    def _warn_of_a_shared_seed(self, backend: Backend) -> None:
        """A server that reports the sampling seed another one does (``sampling_seeds``)."""
        seed = backend.status.sampling_seed
        seeds = {b.address: reported_seed(b.status) for b in self._backends.values()}
        alike = [a for a in shared_seeds(seeds).get(seed, ()) if a != backend.address]
        if alike:
            log.warning(
                "backend %s samples with seed %d, as %s: %s",
                backend.address,
                seed,
                ", ".join(alike),
                ADVICE,
            )

    def _session_moved(self, session: str, left: str, went: str) -> None:
        """A session moved away from ``left``: tell it, so it stops reporting (and every
        placer stops counting) the session there. Best effort: if ``left`` is down, the
        session ends there by idleness, and its reports of it are ignored until then."""
        backend = self._backends.get(left)
        if backend is None:
            return
        log.debug("session %s moved from %s to %s", session, left, went)

        finish = finish_moved_session(
            backend.channel, session, timeout=max(self.check_interval, 1.0)
        )
        self._tasks.spawn(finish, name=f"finish {session} at {left}")

    async def close(self) -> None:
        """Removes every backend and closes its channel (in-flight calls are cut)."""
        backends = list(self._backends.values())
        for backend in backends:
            await self.remove(backend.address)
        await self._tasks.close()
        for backend in backends:
            await backend.channel.close()
