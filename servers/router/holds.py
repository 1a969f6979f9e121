"""Holding calls while the router can reach no server, instead of failing them at once.

When every member is lost together (the router's own link flapping, a partition, a rack's
switch rebooting), a call that finds none serving waits for one to serve again: up to
``--hold-seconds`` and its own deadline (answered ``HOLD_ANSWER_SECONDS`` before it, so its
caller learns why). A stream whose server was lost waits so too, then moves there. What the
router says when there is none (``no_backend_reason``) is written here once. A continuation
(``min_weight_version``: its tokens came from those weights) waits so for a member that serves
them or newer, rather than going on older ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from servers.common.grpc_types import Context
from servers.router.backends import BackendPool
from servers.router.metrics import RouterMetrics
from skyrl_grpc.errors import Unavailable
from skyrl_grpc.v1 import router_pb2

log = logging.getLogger(__name__)

# How long before its deadline a held call is answered UNAVAILABLE (the hold's reason reaches
# its caller instead of DEADLINE_EXCEEDED).
HOLD_ANSWER_SECONDS = 0.5


def no_backend_reason(pool: BackendPool, tried: set[str], min_version: int = 0) -> str:
    """Why no backend takes a call, as its UNAVAILABLE says: none at all, none new enough for
    a continuation, every one ``tried`` failed, or each member's state."""
    members = pool.backends
    if not members:
        return "the router has no backends: add one with RouterAdmin/AddBackend"
    if pool.serving() and not pool.serving(min_version):
        versions = ", ".join(f"{b.address} {b.weight_version}" for b in pool.serving())
        return (
            f"the request continues a sample made at weight version {min_version} "
            f"(min_weight_version) and no healthy backend serves it or newer yet ({versions})"
        )
    if tried and pool.serving():
        return f"every backend tried failed ({', '.join(sorted(tried))})"
    states = ", ".join(
        f"{b.address} {router_pb2.BackendState.Name(b.state)}" + (" standby" if b.standby else "")
        for b in members
    )
    return f"no healthy backend takes calls ({states})"


class CallHolds:
    """The router's holds: ``hold`` for each call, ``holding`` how many wait now."""

    def __init__(
        self, pool: BackendPool, metrics: RouterMetrics, seconds: Callable[[], float]
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._seconds = seconds  # --hold-seconds, read at each hold (tests change it)
        self.holding = 0

    async def hold(self, context: Context, min_version: int = 0) -> bool:
        """When the router has members and none serves (at ``min_version`` or newer), waits
        for one to, up to the hold's seconds and the call's deadline; whether it waited and one
        serves now. False at once where there is nothing to wait for (one serves, no members,
        no hold, no time left); a wait in vain raises UNAVAILABLE, saying so."""
        pool, hold = self._pool, self._seconds()
        if hold <= 0 or not pool.backends or pool.serving(min_version):
            return False
        remaining = context.time_remaining()
        seconds = hold if remaining is None else min(hold, remaining - HOLD_ANSWER_SECONDS)
        if seconds <= 0:
            return False
        began = time.perf_counter()
        self.holding += 1
        try:
            served = await pool.until_serving(seconds, min_version)
        finally:
            self.holding -= 1
        held = time.perf_counter() - began
        self._metrics.held.labels("served" if served else "in vain").observe(held)
        if served:
            log.info("a call held %.1f s while no backend served", held)
            return True
        raise Unavailable(
            f"router: {no_backend_reason(pool, set(), min_version)}; held the call "
            f"{seconds:.1f} s for one to serve (--hold-seconds)"
        )
