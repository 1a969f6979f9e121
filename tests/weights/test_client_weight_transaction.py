"""The fleet weight transaction's rules (``trainer_client.weights.weight_transaction``) against
stand-in servers: every failure, in every phase, on any server, leaves the whole fleet on its
previous version with nothing open, and the next update succeeds."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import pytest

from trainer_client.exceptions import ServerError
from trainer_client.fleet_info import UpdatePhases
from trainer_client.weights.weight_transaction import WeightUpdateError, run_weight_transaction

SERVERS = ["s1:1", "s2:2", "s3:3"]
PHASES = ["start", "transfer", "finish", "finish-after-commit"]


@dataclass
class StandIn:
    """A server's weight transaction state, and a fault to inject once."""

    version: int = 7
    previous: int | None = None
    open: bool = False
    fail: str = ""  # a phase of PHASES
    calls: list[str] = field(default_factory=list)


def lost(address: str) -> ServerError:
    return ServerError(address, grpc.StatusCode.UNAVAILABLE, "connection reset")


class Fleet:
    def __init__(self) -> None:
        self.servers = {a: StandIn() for a in SERVERS}

    def _take_fault(self, address: str, phase: str) -> bool:
        server = self.servers[address]
        if server.fail == phase:
            server.fail = ""
            return True
        return False

    async def start(self, address: str, version: int) -> int:
        server = self.servers[address]
        server.calls.append("start")
        if self._take_fault(address, "start"):
            raise lost(address)
        if version <= server.version:
            raise ServerError(address, grpc.StatusCode.INVALID_ARGUMENT, "not newer")
        server.open, server.previous = True, None
        return server.version

    async def transfer(self, addresses: Sequence[str]) -> dict[str, BaseException]:
        failures: dict[str, BaseException] = {}
        for address in addresses:
            if self._take_fault(address, "transfer"):
                self.servers[address].open = False  # a rejected push closes the update
                failures[address] = ServerError(address, grpc.StatusCode.DATA_LOSS, "crc")
        return failures

    async def finish(self, address: str, version: int) -> None:
        server = self.servers[address]
        server.calls.append("finish")
        if self._take_fault(address, "finish"):
            raise lost(address)
        server.previous, server.version, server.open = server.version, version, False
        if self._take_fault(address, "finish-after-commit"):
            raise lost(address)  # committed, but the answer was lost

    async def cancel(self, address: str) -> None:
        server = self.servers[address]
        server.calls.append("cancel")
        if not server.open:
            raise ServerError(address, grpc.StatusCode.FAILED_PRECONDITION, "nothing open")
        server.open = False

    async def rollback(self, address: str, version: int) -> int:
        server = self.servers[address]
        server.calls.append("rollback")
        assert server.previous is not None and server.version == version
        server.version, server.previous = server.previous, None
        return server.version

    async def serving_version(self, address: str) -> int:
        return self.servers[address].version

    async def release(self, address: str, version: int) -> None:
        server = self.servers[address]
        server.calls.append("release")
        if self._take_fault(address, "release"):
            raise lost(address)
        assert server.version == version and not server.open
        server.previous = None


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("failing", SERVERS)
async def test_a_failure_anywhere_leaves_every_server_on_its_previous_weights(
    phase: str, failing: str
) -> None:
    fleet = Fleet()
    fleet.servers[failing].fail = phase
    with pytest.raises(WeightUpdateError) as raised:
        await run_weight_transaction(SERVERS, 8, fleet, fleet.transfer, release=True)
    error = raised.value
    assert error.consistent, str(error)
    assert {a: s.version for a, s in fleet.servers.items()} == dict.fromkeys(SERVERS, 7)
    assert not any(s.open for s in fleet.servers.values())
    assert {a: o.serving_version for a, o in error.outcomes.items()} == dict.fromkeys(SERVERS, 7)
    assert "failed" in error.outcomes[failing].what and failing in str(error)
    if phase in ("start", "transfer"):
        assert not any("finish" in s.calls for s in fleet.servers.values())
    # A failed update releases nothing: the rollbacks above needed what the servers kept.
    assert not any("release" in s.calls for s in fleet.servers.values())
    # The next update goes through.
    await run_weight_transaction(SERVERS, 8, fleet, fleet.transfer)
    assert {s.version for s in fleet.servers.values()} == {8}


async def test_a_stale_version_is_refused_everywhere_before_anything_moves() -> None:
    fleet = Fleet()
    fleet.servers[SERVERS[1]].version = 9
    moved: list[str] = []

    async def transfer(addresses: Sequence[str]) -> dict[str, BaseException]:
        moved.extend(addresses)
        return {}

    with pytest.raises(WeightUpdateError, match="StartWeightUpdate") as raised:
        await run_weight_transaction(SERVERS, 8, fleet, transfer)
    assert not moved
    assert not raised.value.consistent  # the servers served different versions to begin with
    assert "INVALID_ARGUMENT: not newer" in raised.value.outcomes[SERVERS[1]].what


async def test_a_rollback_that_fails_is_reported_as_inconsistent() -> None:
    fleet = Fleet()
    fleet.servers[SERVERS[0]].fail = "finish"

    async def broken_rollback(address: str, version: int) -> int:
        raise lost(address)

    fleet.rollback = broken_rollback  # type: ignore[method-assign]
    with pytest.raises(WeightUpdateError, match="do not all serve the same weights") as raised:
        await run_weight_transaction(SERVERS, 8, fleet, fleet.transfer)
    assert raised.value.outcomes[SERVERS[1]].serving_version == 8
    assert "rollback failed" in raised.value.outcomes[SERVERS[1]].what


async def test_a_version_every_server_already_serves_is_refused_without_a_false_alarm() -> None:
    fleet = Fleet()  # every server serves 7
    with pytest.raises(WeightUpdateError) as raised:
        await run_weight_transaction(SERVERS, 7, fleet, fleet.transfer)
    error = raised.value
    assert error.consistent and "every server kept its previous weights" in str(error)
    assert "WARNING" not in str(error)
    assert not any("rollback" in s.calls or "finish" in s.calls for s in fleet.servers.values())


async def test_nothing_is_rolled_back_where_nothing_was_committed() -> None:
    # As a real server does with version 0 ("unset" on the wire): the start accepts it, the
    # commit refuses it. Every server still serves what it served before, and none of them
    # committed anything: no rollback may be tried, and no mixed weights reported.
    fleet = Fleet()
    for server in fleet.servers.values():
        server.version = 0

    async def start(address: str, version: int) -> int:
        fleet.servers[address].calls.append("start")
        fleet.servers[address].open = True
        return fleet.servers[address].version

    async def finish(address: str, version: int) -> None:
        fleet.servers[address].calls.append("finish")
        raise ServerError(address, grpc.StatusCode.INVALID_ARGUMENT, "0 is not newer than 0")

    fleet.start = start  # type: ignore[method-assign]
    fleet.finish = finish  # type: ignore[method-assign]
    with pytest.raises(WeightUpdateError) as raised:
        await run_weight_transaction(SERVERS, 0, fleet, fleet.transfer)
    assert raised.value.consistent and "WARNING" not in str(raised.value), str(raised.value)
    assert "every server kept its previous weights" in str(raised.value)
    assert not any("rollback" in s.calls for s in fleet.servers.values())
    assert all("not committed" in o.what for o in raised.value.outcomes.values())


async def test_a_version_below_one_is_refused_before_anything_moves() -> None:
    from trainer_client import InferenceClient

    # Unreachable addresses: the refusal must come before any call.
    client = InferenceClient("127.0.0.1:9", ["127.0.0.1:9"], control_timeout=0.5)
    for version in (0, -3):
        with pytest.raises(ValueError, match="versions start at 1"):
            await client.update_weights([], weight_version=version, transport="grpc")


async def test_the_fleet_commit_releases_every_rollback_copy_when_asked() -> None:
    fleet = Fleet()
    await run_weight_transaction(SERVERS, 8, fleet, fleet.transfer)
    assert all(s.calls[-1] == "finish" and s.previous == 7 for s in fleet.servers.values())
    await run_weight_transaction(SERVERS, 9, fleet, fleet.transfer, release=True)
    for server in fleet.servers.values():
        assert server.calls[-2:] == ["finish", "release"] and server.previous is None
    # A release that fails does not fail the committed update: that server keeps its copy.
    fleet.servers[SERVERS[0]].fail = "release"
    commits = await run_weight_transaction(SERVERS, 10, fleet, fleet.transfer, release=True)
    assert set(commits) == set(SERVERS)
    assert {a: s.previous for a, s in fleet.servers.items()} == {
        SERVERS[0]: 9,
        SERVERS[1]: None,
        SERVERS[2]: None,
    }


async def test_each_phase_the_trainer_waited_for_is_timed() -> None:
    """``phases``: start, transfer, commit and release, each timed around what it waited for
    (lower bounds, which hold on a busy machine)."""
    fleet = Fleet()
    pause = 0.05

    async def slow_transfer(addresses: Sequence[str]) -> dict[str, BaseException]:
        await asyncio.sleep(pause)
        return await fleet.transfer(addresses)

    async def slow_release(address: str, version: int) -> None:
        await asyncio.sleep(2 * pause)
        await Fleet.release(fleet, address, version)

    fleet.release = slow_release  # type: ignore[method-assign]
    phases = UpdatePhases()
    await run_weight_transaction(SERVERS, 8, fleet, slow_transfer, release=True, phases=phases)
    assert set(phases) == {"start", "transfer", "commit", "release"}
    assert phases["transfer"] >= pause and phases["release"] >= 2 * pause
    assert all(seconds >= 0 for seconds in phases.values())
