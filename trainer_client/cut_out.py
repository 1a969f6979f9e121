"""Cutting a server the trainer cannot reach out of the fleet's control calls and weight
updates instead of holding the fleet for it (``ClientConfig.cut_out_unreachable``, or
``update_weights(cut_out_unreachable=True)`` for one update).

A server the trainer cannot reach (a partition, a host whose network hangs while its
processes live on) would fail a weight update at the update's ``timeout``, and hold a pause
or a resume until the call's deadline; every retry would meet it again until the partition
heals. A trainer wants its next step on one version as soon as possible. So:

- A failed update runs again at once on the servers that answered, and commits there
  (``commit_cutting_out``). Only a server whose version could not be asked after the
  failure is cut out (``unreachable``): one that answers and refused the update (a rejected
  chunk, a wrong shape) fails it as before, so bad weights are never committed by leaving
  their critic out.
- A pause or resume does not wait on a server that answers nothing: while its call is under
  way (from ``FIRST_PROBE_AFTER_SECONDS`` on, then every ``PROBE_SECONDS``) the server is
  asked over a channel of its own whether it answers at all; if not, the call there is given
  up and the server cut out (``unless_cut_off``). A server that answers but takes its time (a
  pause that waits for its generations) is waited for.

A server cut out keeps the weights it served, so once the others commit an update the router
and the direct path place no call on it (never on a server behind the newest version). The
client remembers it (``ClientCore.cut_out``): a later pause, resume or update asks it again
over a fresh channel, every ``ASK_AGAIN_SECONDS``, and takes it back once it answers
(``rejoining``); an update then sends it the whole weights, since it serves another version
than the delta's base. The call waits ``REJOIN_WAIT_SECONDS`` for that answer, not the
probe's whole ``PROBE_SECONDS``: a server still cut off costs a step that little, and one
that answers later is taken back by the next call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from trainer_client.exceptions import ServerError
from trainer_client.weights.weight_transaction import WeightUpdateError

T = TypeVar("T")
log = logging.getLogger(__name__)

# How long a server has to answer a probe (it answers in milliseconds when reachable; a
# partitioned one never does): before a call takes a server cut out back, and every this often
# while a call to a server is under way.
PROBE_SECONDS = 2.0
# How long a call may take before its server is first asked whether it answers at all (a
# pause or resume takes milliseconds on a server that is reachable and idle).
FIRST_PROBE_AFTER_SECONDS = 0.5
# How long a server that answered no probe is left out before a call asks it again.
ASK_AGAIN_SECONDS = 10.0
# How long a call waits for a server cut out to answer before it goes on without it (the probe
# goes on in the background for its PROBE_SECONDS, and a late answer takes the server back for
# the next call): a healed server answers a fresh channel in a few round trips, well inside
# it on a busy host too.
REJOIN_WAIT_SECONDS = 1.0
# How long a failed update's cancel and version question may wait on each server when a
# server that does not answer is cut out (a reachable one answers in milliseconds): without
# it, each waits the client's control timeout before the others can go on.
CLEANUP_SECONDS = 5.0
# The statuses a call to a server that cannot be reached ends with.
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# Whether a server answers a probe within the given seconds.
Probe = Callable[[str, float], Awaitable[bool]]
# Runs a coroutine in the background of the running loop, cancelled when the loop's client
# closes (``Connections.spawn``).
Spawn = Callable[[Coroutine[Any, Any, None]], None]


class CutOff:
    """What ``unless_cut_off`` returns for a server it cut out, instead of the call's result."""

    def __init__(self, why: str) -> None:
        self.why = why


def cutting_out(asked: bool | None, configured: bool, *, collective: bool) -> bool:
    """Whether an update cuts out servers it cannot reach: as ``asked`` (None: as
    ``configured``, the client's setting), never over the collective group, whose broadcasts
    need every rank (asked for there: refused)."""
    if not collective:
        return configured if asked is None else asked
    if asked:
        raise ValueError(
            "cut_out_unreachable: in-band updates only (a collective broadcast needs every rank "
            "of its group): use transport='grpc'"
        )
    return False


def unreachable(failed: WeightUpdateError) -> dict[str, str]:
    """The servers of a failed update that could not even be asked which version they serve,
    with what happened there; empty when a server that answered serves the update's version
    (something was committed: nothing is tried again on a fleet in that state)."""
    if any(o.serving_version == failed.version for o in failed.outcomes.values()):
        return {}
    return {
        address: outcome.what
        for address, outcome in failed.outcomes.items()
        if outcome.serving_version is None
    }


class CutOutServers(dict[str, str]):
    """The servers cut out, each with why (``ClientCore.cut_out``), and when each last
    answered nothing: a server that did is not asked again for ``ASK_AGAIN_SECONDS``, so a
    trainer's step (a pause, an update, a resume) does not wait a probe out at each call."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._silent_at: dict[str, float] = {}

    def __setitem__(self, address: str, why: str) -> None:
        super().__setitem__(address, why)
        self.silent(address)

    def __delitem__(self, address: str) -> None:
        super().__delitem__(address)
        self._silent_at.pop(address, None)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for address, why in dict(*args, **kwargs).items():
            self[address] = why

    def silent(self, address: str) -> None:
        """``address`` answered nothing just now."""
        self._silent_at[address] = self._clock()

    def due(self, address: str) -> bool:
        """Whether ``address`` is to be asked again (silent long enough ago)."""
        return self._clock() - self._silent_at.get(address, 0.0) >= ASK_AGAIN_SECONDS


async def rejoining(
    cut_out: CutOutServers,
    servers: Sequence[str],
    answers: Probe,
    spawn: Spawn,
) -> tuple[list[str], dict[str, str]]:
    """Of ``servers``, the ones to call now (every server not in ``cut_out``, and each one
    there that is ``due`` and ``answers`` within ``REJOIN_WAIT_SECONDS``), and the ones that
    stay out with why. ``cut_out`` is updated: a server that answered leaves it, also when its
    answer comes after the wait (its probe goes on, ``spawn``-ed, for ``PROBE_SECONDS``), and
    a server no longer in the fleet is forgotten. When none would be left, all of them are
    tried (the call then fails naming each)."""
    for gone in set(cut_out).difference(servers):
        del cut_out[gone]

    async def ask(address: str) -> None:
        if await answers(address, PROBE_SECONDS) and address in cut_out:
            log.info("%s answers again: taken back (an update sends it the whole weights)", address)
            del cut_out[address]

    asked = [a for a in servers if a in cut_out and cut_out.due(a)]
    for address in asked:
        cut_out.silent(address)  # not asked again while this probe runs, nor after it if silent
    probes = [asyncio.ensure_future(ask(a)) for a in asked]
    if probes:
        _, late = await asyncio.wait(probes, timeout=REJOIN_WAIT_SECONDS)
        for probe in late:
            spawn(_finish(probe))
    now = [a for a in servers if a not in cut_out]
    if not now:
        return list(servers), {}
    return now, {a: cut_out[a] for a in servers if a in cut_out}


async def _finish(probe: asyncio.Future[None]) -> None:
    """Waits ``probe`` out (cancelling this cancels it)."""
    await probe


async def commit_cutting_out(
    servers: Sequence[str],
    attempt: Callable[[Sequence[str]], Awaitable[T]],
    cut_out: CutOutServers,
) -> tuple[T, dict[str, str]]:
    """``attempt(servers)``, and while it fails with servers that could not be reached
    (``unreachable``) and others that answered on their previous weights, again at once on
    those others; returns its result and the servers left out, with why, each also added to
    ``cut_out``. Raises the failure when every server failed unreachable, or any other way."""
    left, cut_now = list(servers), dict[str, str]()
    while True:
        try:
            return await attempt(left), cut_now
        except WeightUpdateError as failed:
            lost = unreachable(failed)
            if not lost or set(left) <= set(lost):
                raise
            log.warning(
                "weight update to version %d: cutting out %s (unreachable: %s); trying again "
                "at once on %s (a later update takes each back once it answers)",
                failed.version,
                ", ".join(sorted(lost)),
                "; ".join(lost[a] for a in sorted(lost)),
                ", ".join(a for a in left if a not in lost),
            )
            for address, why in lost.items():
                cut_out[address] = cut_now[address] = why
            left = [a for a in left if a not in lost]


async def unless_cut_off(
    address: str, call: Awaitable[T], answers: Probe, cut_out: CutOutServers
) -> T | CutOff:
    """``call``'s result, or a ``CutOff`` once ``address`` answers no probe (``answers``, a
    channel apart from the call's) while the call is under way, or after the call failed as
    a lost server's call does; the server is then added to ``cut_out``. Any other failure,
    and a lost call's on a server that still answers, is raised."""
    task = asyncio.ensure_future(call)
    wait = FIRST_PROBE_AFTER_SECONDS
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=wait)
            wait = PROBE_SECONDS
            if done:
                try:
                    return task.result()
                except ServerError as error:
                    if error.code not in LOST or await answers(address, PROBE_SECONDS):
                        raise
                    why = f"{error.code.name}: {error.details}"
                    break
            if not await answers(address, PROBE_SECONDS):
                why = f"answered no probe within {PROBE_SECONDS:.0f} s"
                break
    finally:
        task.cancel()  # a call given up on a server cut off (nothing where it ended)
    log.warning("%s cut out (%s): the call goes on without it", address, why)
    cut_out[address] = why
    return CutOff(why)
