"""One weight update across a fleet: every server commits the new version, or none serves it.

``run_weight_transaction`` drives the servers' own transactions (StartWeightUpdate, the
transfer, FinishWeightUpdate) as one, through the calls it is given, so its rules are tested
without a network:

1. Start everywhere, naming the target version (each server checks it before any weight
   travels). A server that refuses or cannot be reached: the update is cancelled wherever it
   opened, and nothing was sent.
2. Transfer. Any failure (a rejected chunk, a timeout, a lost server): cancelled everywhere.
3. Finish everywhere. If a server did not commit, every server that did is rolled back to the
   weights it served before (a server whose answer was lost is asked which version it serves,
   and rolled back if the commit happened there); the rest are cancelled.
4. Every server committed: the fleet's commit point. With ``release``, each server is told to
   free the previous weights it kept for step 3 and give their memory back to the system
   (otherwise they stay until its next update starts, for a later ``rollback_weights``). A
   server that misses the release keeps its copy until then; the update succeeded all the
   same.

On failure ``WeightUpdateError`` says, per server, what happened and which version it serves
now, so a fleet is never left on mixed weights without the error saying so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from trainer_client.exceptions import InferenceError, ServerError
from trainer_client.fanout import failures_of
from trainer_client.fleet_info import UpdatePhases

R = TypeVar("R", covariant=True)
log = logging.getLogger(__name__)


class TransactionCalls(Protocol[R]):
    """The per-server calls a fleet transaction makes (the client's gRPC calls); ``finish``
    returns what a server answers to its commit."""

    async def start(self, address: str, version: int) -> int:
        """Opens the update; returns the version the server served when it opened."""
        ...

    async def finish(self, address: str, version: int) -> R: ...

    async def cancel(self, address: str) -> None: ...

    async def rollback(self, address: str, version: int) -> int: ...

    async def serving_version(self, address: str) -> int: ...

    async def release(self, address: str, version: int) -> None: ...


# Moves the weights to the servers given; returns each one's failure (absent: it succeeded).
Transfer = Callable[[Sequence[str]], Awaitable[dict[str, BaseException]]]


@dataclass
class ServerOutcome:
    """What a failed transaction did on one server."""

    what: str  # e.g. "PushWeights failed: DATA_LOSS: ...; cancelled"
    serving_version: int | None  # the version it serves now (None: it could not be asked)


class WeightUpdateError(InferenceError):
    """A fleet weight update failed. ``outcomes`` maps every server to what happened there and
    the version it serves now; ``consistent`` is True when every server that answered serves
    the same version (their previous weights, unless a rollback failed everywhere)."""

    def __init__(
        self,
        version: int,
        phase: str,
        outcomes: dict[str, ServerOutcome],
        previous: dict[str, int] | None = None,
    ) -> None:
        self.version = version
        self.phase = phase
        self.outcomes = outcomes
        served = {o.serving_version for o in outcomes.values() if o.serving_version is not None}
        self.consistent = len(served) <= 1
        summary = "; ".join(
            f"{address}: {o.what}, serves {'?' if o.serving_version is None else o.serving_version}"
            for address, o in sorted(outcomes.items())
        )
        if not self.consistent:
            verdict = "WARNING: the servers do not all serve the same weights"
        elif all(
            o.serving_version in (None, (previous or {}).get(a, o.serving_version))
            for a, o in outcomes.items()
        ):
            verdict = "every server kept its previous weights"
        else:
            verdict = f"every server serves version {served.pop()}"
        super().__init__(
            f"weight update to version {version} failed at {phase}; {verdict}: {summary}"
        )


def _describe(error: BaseException) -> str:
    if isinstance(error, ServerError):
        return f"{error.code.name}: {error.details}"
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


async def run_weight_transaction(
    servers: Sequence[str],
    version: int,
    calls: TransactionCalls[R],
    transfer: Transfer,
    *,
    release: bool = False,
    phases: UpdatePhases | None = None,
) -> dict[str, R]:
    """Commits ``version`` on every server or on none, returning each server's answer to the
    commit (and the seconds of each phase in ``phases``); see the module docstring."""
    timed = (phases if phases is not None else UpdatePhases()).timed
    before: dict[str, int] = {}

    async def start(address: str) -> None:
        before[address] = await calls.start(address, version)

    with timed("start"):
        started_failures = await failures_of(servers, start)
    if started_failures:
        await _abort(servers, version, calls, "StartWeightUpdate", started_failures, before)
    try:
        with timed("transfer"):
            transfer_failures = await transfer(servers)
    except BaseException as error:  # the transfer itself broke (e.g. the caller cancelled)
        await _cancel_everywhere(servers, calls)
        raise error
    if transfer_failures:
        await _abort(servers, version, calls, "the transfer", transfer_failures, before)
    committed: dict[str, R] = {}

    async def finish(address: str) -> None:
        committed[address] = await calls.finish(address, version)

    with timed("commit"):
        finish_failures = await failures_of(servers, finish)
    if finish_failures:
        await _undo_commits(servers, version, calls, finish_failures, before, set(committed))
    if release:
        with timed("release"):
            missed = await failures_of(servers, lambda address: calls.release(address, version))
        for address, failure in missed.items():
            log.warning(
                "%s keeps its previous weights until its next update: the release after the "
                "fleet's commit of version %d failed (%s)",
                address,
                version,
                _describe(failure),
            )
    return committed


async def _cancel_everywhere(servers: Sequence[str], calls: TransactionCalls[object]) -> None:
    await failures_of(servers, calls.cancel)  # where nothing is open, there is nothing to undo


async def _serving_versions(
    servers: Sequence[str], calls: TransactionCalls[object]
) -> dict[str, int | None]:
    async def ask(address: str) -> int | None:
        try:
            return await calls.serving_version(address)
        except Exception:
            return None

    versions = await asyncio.gather(*(ask(a) for a in servers))
    return dict(zip(servers, versions, strict=True))


async def _abort(
    servers: Sequence[str],
    version: int,
    calls: TransactionCalls[object],
    phase: str,
    failures: dict[str, BaseException],
    before: dict[str, int],
) -> None:
    """Nothing was committed: cancel everywhere, report, raise."""
    await _cancel_everywhere(servers, calls)
    versions = await _serving_versions(servers, calls)
    outcomes = {
        address: ServerOutcome(
            f"{phase} failed ({_describe(failures[address])}); cancelled"
            if address in failures
            else "cancelled",
            versions[address],
        )
        for address in servers
    }
    raise WeightUpdateError(version, phase, outcomes, before)


async def _undo_commits(
    servers: Sequence[str],
    version: int,
    calls: TransactionCalls[object],
    finish_failures: dict[str, BaseException],
    before: dict[str, int],
    committed: set[str],
) -> None:
    """Some servers did not commit: roll back every server that did (it answered the commit,
    or its answer was lost but it serves the new version it did not serve before), cancel the
    rest. Nothing is rolled back where nothing was committed."""
    versions = await _serving_versions(servers, calls)
    outcomes: dict[str, ServerOutcome] = {}

    async def undo(address: str) -> None:
        failed = (
            f"FinishWeightUpdate failed ({_describe(finish_failures[address])})"
            if address in finish_failures
            else "committed"
        )
        lost_commit = versions[address] == version and before.get(address) != version
        if address in committed or lost_commit:
            try:
                restored = await calls.rollback(address, version)
                outcomes[address] = ServerOutcome(f"{failed}; rolled back", restored)
            except Exception as error:
                outcomes[address] = ServerOutcome(
                    f"{failed}; rollback failed ({_describe(error)})", version
                )
            return
        try:
            await calls.cancel(address)
        except Exception:
            pass  # nothing open there any more: the failed finish closed it
        outcomes[address] = ServerOutcome(f"{failed}; not committed", versions[address])

    await asyncio.gather(*(undo(a) for a in servers))
    raise WeightUpdateError(version, "FinishWeightUpdate", outcomes, before)
