"""Cutting an unreachable server out of a weight update instead of holding the fleet for it
(``update_weights(cut_out_unreachable=True)``).

A server the trainer cannot reach (a partition, a host whose network hangs while its
processes live on) fails an update at the update's ``timeout``, and every other server keeps
its previous weights. A trainer wants its next step on one version as soon as possible: so the
update runs again at once on the servers that answered, and commits there. The server left out
keeps the version it served, so the router and the direct path place no call on it (they never
place one on a server behind the newest version), and the client remembers it: each later
update first asks it (``PROBE_SECONDS``), takes it back if it answers, and sends it the whole
weights in that update, since it serves another version than the delta's base. Until then it
stays out, without the update waiting on it again.

Only a server whose version could not be asked after the failure is cut out: one that answers
and refused the update (a rejected chunk, a wrong shape) fails it as before, so bad weights
are never committed anywhere by leaving their critic out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from trainer_client.weights.weight_transaction import WeightUpdateError

T = TypeVar("T")
log = logging.getLogger(__name__)

# How long a server cut out of an earlier update has to answer before the next update takes
# it back (it answers in milliseconds when reachable; a partitioned one never does).
PROBE_SECONDS = 2.0
# How long a failed update's cancel and version question may wait on each server when a
# server that does not answer is cut out (a reachable one answers in milliseconds): without
# it, each waits the client's control timeout before the others can go on.
CLEANUP_SECONDS = 5.0


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


async def rejoining(
    cut_out: dict[str, str],
    servers: Sequence[str],
    answers: Callable[[str, float], Awaitable[bool]],
) -> tuple[list[str], dict[str, str]]:
    """Of ``servers``, the ones to update now (every server not in ``cut_out``, and each one
    there that ``answers`` within ``PROBE_SECONDS``), and the ones that stay out with why.
    ``cut_out`` is updated: a server that answered leaves it, and a server no longer in the
    fleet is forgotten. When none would be left, all of them are tried (the update then fails
    naming each)."""
    for gone in set(cut_out).difference(servers):
        del cut_out[gone]
    asked = [a for a in servers if a in cut_out]
    back = await asyncio.gather(*(answers(a, PROBE_SECONDS) for a in asked))
    for address, answered in zip(asked, back, strict=True):
        if answered:
            log.info("%s answers again: this update takes it back, with the whole weights", address)
            del cut_out[address]
    now = [a for a in servers if a not in cut_out]
    if not now:
        return list(servers), {}
    return now, {a: cut_out[a] for a in asked if a in cut_out}


async def commit_cutting_out(
    servers: Sequence[str],
    attempt: Callable[[Sequence[str]], Awaitable[T]],
    cut_out: dict[str, str],
) -> T:
    """``attempt(servers)``, and while it fails with servers that could not be reached
    (``unreachable``) and others that answered on their previous weights, again at once on
    those others; each server left out is added to ``cut_out``. Raises the failure when every
    server failed unreachable, or any other way."""
    left = list(servers)
    while True:
        try:
            return await attempt(left)
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
            cut_out.update(lost)
            left = [a for a in left if a not in lost]
