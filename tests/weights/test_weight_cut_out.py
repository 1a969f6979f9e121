"""Cutting an unreachable server out of a weight update (``trainer_client.weights.cut_out``)
against the stand-in servers of the transaction's own tests: a server that cannot be reached
at all is left out and the update commits on the others at once; a server that answers and
refused the update is never left out (its refusal fails the update everywhere); a server cut
out is taken back by the first later update it answers."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest

from tests.weights.test_client_weight_transaction import SERVERS, Fleet, lost
from trainer_client.exceptions import ServerError
from trainer_client.weights.cut_out import commit_cutting_out, rejoining, unreachable
from trainer_client.weights.weight_transaction import (
    ServerOutcome,
    WeightUpdateError,
    run_weight_transaction,
)


class PartitionedFleet(Fleet):
    """The stand-in fleet with servers that answer nothing (every call fails UNAVAILABLE, as a
    call to a partitioned host does once its deadline or keepalive gives up)."""

    def __init__(self, cut: Sequence[str] = ()) -> None:
        super().__init__()
        self.cut = set(cut)
        self.tries: list[list[str]] = []

    def _reach(self, address: str) -> None:
        if address in self.cut:
            raise lost(address)

    async def start(self, address: str, version: int) -> int:
        self._reach(address)
        return await super().start(address, version)

    async def transfer(self, addresses: Sequence[str]) -> dict[str, BaseException]:
        self.tries.append(list(addresses))
        failures = await super().transfer([a for a in addresses if a not in self.cut])
        return {**failures, **{a: lost(a) for a in addresses if a in self.cut}}

    async def finish(self, address: str, version: int) -> None:
        self._reach(address)
        await super().finish(address, version)

    async def cancel(self, address: str) -> None:
        self._reach(address)
        await super().cancel(address)

    async def serving_version(self, address: str) -> int:
        self._reach(address)
        return await super().serving_version(address)

    async def answers(self, address: str, seconds: float) -> bool:
        return address not in self.cut

    def versions(self) -> dict[str, int]:
        return {a: s.version for a, s in self.servers.items()}


async def update(fleet: PartitionedFleet, servers: Sequence[str], version: int) -> None:
    await run_weight_transaction(servers, version, fleet, fleet.transfer)


@pytest.mark.parametrize("phase", ["start", "transfer"])
async def test_a_server_cut_off_is_cut_out_and_the_others_commit_at_once(phase: str) -> None:
    fleet = PartitionedFleet()
    if phase == "start":
        fleet.cut.add(SERVERS[1])  # unreachable before the update
    else:
        original = fleet.transfer

        async def cut_during(  # reachable at the start, cut during the transfer
            addresses: Sequence[str],
        ) -> dict[str, BaseException]:
            fleet.cut.add(SERVERS[1])
            return await original(addresses)

        fleet.transfer = cut_during  # type: ignore[method-assign]
    cut_out: dict[str, str] = {}
    await commit_cutting_out(SERVERS, lambda s: update(fleet, s, 8), cut_out)
    assert list(cut_out) == [SERVERS[1]] and "UNAVAILABLE" in cut_out[SERVERS[1]], cut_out
    others = [SERVERS[0], SERVERS[2]]
    assert {a: fleet.versions()[a] for a in others} == dict.fromkeys(others, 8)
    assert fleet.versions()[SERVERS[1]] == 7  # left on its previous weights
    assert not any(fleet.servers[a].open for a in others)


async def test_a_server_that_answers_and_refuses_is_never_cut_out() -> None:
    """A rejected chunk (the server answers, on its previous version) fails the whole update:
    leaving its critic out would commit weights a server found wrong."""
    fleet = PartitionedFleet()
    fleet.servers[SERVERS[2]].fail = "transfer"  # DATA_LOSS from a reachable server
    cut_out: dict[str, str] = {}
    with pytest.raises(WeightUpdateError) as raised:
        await commit_cutting_out(SERVERS, lambda s: update(fleet, s, 8), cut_out)
    assert unreachable(raised.value) == {}
    assert cut_out == {} and len(fleet.tries) == 1
    assert fleet.versions() == dict.fromkeys(SERVERS, 7)


async def test_every_server_unreachable_fails_the_update_instead_of_cutting_out_all() -> None:
    fleet = PartitionedFleet(cut=SERVERS)
    cut_out: dict[str, str] = {}
    with pytest.raises(WeightUpdateError):
        await commit_cutting_out(SERVERS, lambda s: update(fleet, s, 8), cut_out)
    assert cut_out == {}


async def test_nothing_is_tried_again_once_a_server_committed() -> None:
    """A failure after a commit somewhere (a rollback that could not reach a server that
    committed) is reported, never retried on a fleet whose state is not its previous one."""
    failed = WeightUpdateError(
        8,
        "FinishWeightUpdate",
        {
            SERVERS[0]: ServerOutcome("committed; rollback failed", 8),
            SERVERS[1]: ServerOutcome("FinishWeightUpdate failed (UNAVAILABLE)", None),
        },
    )
    assert unreachable(failed) == {}


async def test_a_cut_out_server_stays_out_while_silent_and_rejoins_once_it_answers() -> None:
    fleet = PartitionedFleet(cut=[SERVERS[1]])
    cut_out: dict[str, str] = {}
    await commit_cutting_out(SERVERS, lambda s: update(fleet, s, 8), cut_out)
    # Still silent: the next update leaves it out without trying it (no wait on it).
    now, still = await rejoining(cut_out, SERVERS, fleet.answers)
    assert now == [SERVERS[0], SERVERS[2]] and list(still) == [SERVERS[1]]
    tries = len(fleet.tries)
    await commit_cutting_out(now, lambda s: update(fleet, s, 9), cut_out)
    assert len(fleet.tries) == tries + 1  # one try: the silent server was not in it
    # Healed: it answers, so the next update takes it back (it gets the whole weights there,
    # serving another version than the others: ``update_plan``).
    fleet.cut.clear()
    now, still = await rejoining(cut_out, SERVERS, fleet.answers)
    assert now == SERVERS and still == {} and cut_out == {}
    await commit_cutting_out(now, lambda s: update(fleet, s, 10), cut_out)
    assert fleet.versions() == dict.fromkeys(SERVERS, 10)


async def test_a_server_gone_from_the_fleet_is_forgotten_and_none_left_tries_all() -> None:
    cut_out = {"gone:1": "UNAVAILABLE", SERVERS[0]: "UNAVAILABLE"}

    async def silent(address: str, seconds: float) -> bool:
        return False

    now, still = await rejoining(cut_out, SERVERS, silent)
    assert "gone:1" not in cut_out and now == SERVERS[1:] and list(still) == [SERVERS[0]]
    # Every server cut out and silent: all are tried, so the update fails naming each.
    cut_out = dict.fromkeys(SERVERS, "UNAVAILABLE")
    now, still = await rejoining(cut_out, SERVERS, silent)
    assert now == SERVERS and still == {}


def test_a_server_error_of_its_own_is_not_unreachability() -> None:
    refused = ServerError(SERVERS[0], grpc.StatusCode.INVALID_ARGUMENT, "shape")
    failed = WeightUpdateError(
        8, "the transfer", {SERVERS[0]: ServerOutcome(f"failed ({refused.details})", 7)}
    )
    assert unreachable(failed) == {}
