"""Cutting an unreachable server out (``trainer_client.cut_out``), against the stand-in servers
of the weight transaction's own tests: a server that cannot be reached at all is left out and
the update commits on the others at once; a server that answers and refused the update is
never left out (its refusal fails the update everywhere); a server cut out is taken back by the
first later call it answers; a control call under way is given up on a server that answers no
probe, and waited for on one that answers but takes its time."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc
import pytest

from tests.weights.test_client_weight_transaction import SERVERS, Fleet, lost
from trainer_client.cut_out import (
    ASK_AGAIN_SECONDS,
    PROBE_SECONDS,
    CutOff,
    CutOutServers,
    commit_cutting_out,
    cutting_out,
    rejoining,
    unless_cut_off,
    unreachable,
)
from trainer_client.exceptions import ServerError
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


class Background(set[asyncio.Task[None]]):
    """A ``spawn`` that keeps what it ran (``Connections.spawn`` in the client)."""

    def __call__(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self.add(asyncio.ensure_future(coroutine))


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
    cut_out = CutOutServers()
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
    cut_out = CutOutServers()
    with pytest.raises(WeightUpdateError) as raised:
        await commit_cutting_out(SERVERS, lambda s: update(fleet, s, 8), cut_out)
    assert unreachable(raised.value) == {}
    assert cut_out == {} and len(fleet.tries) == 1
    assert fleet.versions() == dict.fromkeys(SERVERS, 7)


async def test_every_server_unreachable_fails_the_update_instead_of_cutting_out_all() -> None:
    fleet = PartitionedFleet(cut=SERVERS)
    cut_out = CutOutServers()
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


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_cut_out_server_stays_out_while_silent_and_rejoins_once_it_answers() -> None:
    fleet, clock = PartitionedFleet(cut=[SERVERS[1]]), Clock()
    cut_out = CutOutServers(clock)
    await commit_cutting_out(SERVERS, lambda s: update(fleet, s, 8), cut_out)
    asked: list[str] = []

    async def answers(address: str, seconds: float) -> bool:
        asked.append(address)
        return await fleet.answers(address, seconds)

    # Just found silent: the next call leaves it out without asking it (a step's pause,
    # update and resume do not each wait a probe out).
    now, still = await rejoining(cut_out, SERVERS, answers, Background())
    assert now == [SERVERS[0], SERVERS[2]] and list(still) == [SERVERS[1]] and asked == []
    # Later, asked again, still silent: left out again, and the update does not try it.
    clock.now += ASK_AGAIN_SECONDS
    now, still = await rejoining(cut_out, SERVERS, answers, Background())
    assert now == [SERVERS[0], SERVERS[2]] and asked == [SERVERS[1]]
    tries = len(fleet.tries)
    await commit_cutting_out(now, lambda s: update(fleet, s, 9), cut_out)
    assert len(fleet.tries) == tries + 1  # one try: the silent server was not in it
    # Healed: it answers once asked again, so the next update takes it back (it gets the whole
    # weights there, serving another version than the others: ``update_plan``).
    fleet.cut.clear()
    now, _ = await rejoining(cut_out, SERVERS, answers, Background())
    assert SERVERS[1] not in now  # not asked again yet
    clock.now += ASK_AGAIN_SECONDS
    now, still = await rejoining(cut_out, SERVERS, answers, Background())
    assert now == SERVERS and still == {} and cut_out == {}
    await commit_cutting_out(now, lambda s: update(fleet, s, 10), cut_out)
    assert fleet.versions() == dict.fromkeys(SERVERS, 10)


async def test_a_silent_server_costs_a_call_the_rejoin_wait_and_a_late_answer_takes_it_back() -> (
    None
):
    """A server still cut off holds a call ``REJOIN_WAIT_SECONDS`` (the probe goes on in the
    background), not a whole probe; one that answers after that wait is taken back by the next
    call."""
    clock, background = Clock(), Background()
    cut_out = CutOutServers(clock)
    cut_out[SERVERS[1]] = "UNAVAILABLE"
    clock.now += ASK_AGAIN_SECONDS
    answer = asyncio.Event()

    async def late(address: str, seconds: float) -> bool:
        assert seconds == PROBE_SECONDS
        await answer.wait()
        return True

    now, still = await rejoining(cut_out, SERVERS, late, background)
    assert now == [SERVERS[0], SERVERS[2]] and list(still) == [SERVERS[1]]
    (probe,) = background  # the call went on while its probe still waits for an answer
    assert not probe.done()
    assert not cut_out.due(SERVERS[1])  # its probe runs on: no second one meanwhile
    answer.set()
    await probe
    assert cut_out == {}
    now, still = await rejoining(cut_out, SERVERS, late, background)
    assert now == SERVERS and still == {}


async def test_a_server_gone_from_the_fleet_is_forgotten_and_none_left_tries_all() -> None:
    clock = Clock()
    cut_out = CutOutServers(clock)
    cut_out.update({"gone:1": "UNAVAILABLE", SERVERS[0]: "UNAVAILABLE"})
    clock.now += ASK_AGAIN_SECONDS

    async def silent(address: str, seconds: float) -> bool:
        return False

    now, still = await rejoining(cut_out, SERVERS, silent, Background())
    assert "gone:1" not in cut_out and now == SERVERS[1:] and list(still) == [SERVERS[0]]
    # Every server cut out and silent: all are tried, so the call fails naming each.
    cut_out = CutOutServers(clock)
    for server in SERVERS:
        cut_out[server] = "UNAVAILABLE"
    now, still = await rejoining(cut_out, SERVERS, silent, Background())
    assert now == SERVERS and still == {}


def test_a_server_error_of_its_own_is_not_unreachability() -> None:
    refused = ServerError(SERVERS[0], grpc.StatusCode.INVALID_ARGUMENT, "shape")
    failed = WeightUpdateError(
        8, "the transfer", {SERVERS[0]: ServerOutcome(f"failed ({refused.details})", 7)}
    )
    assert unreachable(failed) == {}


def test_an_update_over_the_collective_group_never_cuts_out() -> None:
    assert cutting_out(None, True, collective=False) and not cutting_out(
        False, True, collective=False
    )
    assert not cutting_out(None, True, collective=True)  # the client's setting: not there
    with pytest.raises(ValueError, match="in-band updates only"):
        cutting_out(True, False, collective=True)


async def test_a_call_is_given_up_on_a_server_that_answers_no_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("trainer_client.cut_out.PROBE_SECONDS", 0.01)
    monkeypatch.setattr("trainer_client.cut_out.FIRST_PROBE_AFTER_SECONDS", 0.01)
    hanging = asyncio.get_running_loop().create_future()  # a call into a partition
    cut_out = CutOutServers()

    async def silent(address: str, seconds: float) -> bool:
        return False

    outcome = await unless_cut_off("s:1", hanging, silent, cut_out)
    assert isinstance(outcome, CutOff) and "probe" in outcome.why
    assert list(cut_out) == ["s:1"]
    assert hanging.cancelled()  # given up, not left running


async def test_a_slow_call_on_a_server_that_answers_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("trainer_client.cut_out.PROBE_SECONDS", 0.01)
    monkeypatch.setattr("trainer_client.cut_out.FIRST_PROBE_AFTER_SECONDS", 0.01)
    probes: list[str] = []
    third_probe = asyncio.Event()

    async def alive(address: str, seconds: float) -> bool:
        probes.append(address)
        if len(probes) >= 3:
            third_probe.set()
        return True

    async def slow_pause() -> str:  # a pause that waits for its generations
        await third_probe.wait()
        return "paused"

    cut_out = CutOutServers()
    assert await unless_cut_off("s:1", slow_pause(), alive, cut_out) == "paused"
    assert cut_out == {} and len(probes) >= 3


async def test_a_lost_call_cuts_out_only_a_server_that_answers_no_probe() -> None:
    async def lost_call() -> None:
        raise lost("s:1")

    async def refused() -> None:
        raise ServerError("s:1", grpc.StatusCode.FAILED_PRECONDITION, "paused for an update")

    async def silent(address: str, seconds: float) -> bool:
        return False

    async def alive(address: str, seconds: float) -> bool:
        return True

    cut_out = CutOutServers()
    outcome = await unless_cut_off("s:1", lost_call(), silent, cut_out)
    assert isinstance(outcome, CutOff) and cut_out == {"s:1": "UNAVAILABLE: connection reset"}
    with pytest.raises(ServerError):  # lost, yet it answers: the failure is the call's own
        await unless_cut_off("s:2", lost_call(), alive, CutOutServers())
    with pytest.raises(ServerError):  # a refusal is never a cut-out, answering or not
        await unless_cut_off("s:3", refused(), silent, CutOutServers())


def test_a_client_says_which_servers_are_cut_out_and_why() -> None:
    """``cut_out_servers``: what a run that must end whole waits to see empty; a copy, so a
    caller's edits change nothing."""
    from trainer_client import BlockingInferenceClient, InferenceClient

    client = InferenceClient("router:1", SERVERS, cut_out_unreachable=True)
    assert client.cut_out_servers == {}
    client._core.cut_out[SERVERS[1]] = "UNAVAILABLE: no route"
    seen = client.cut_out_servers
    assert seen == {SERVERS[1]: "UNAVAILABLE: no route"}
    seen.clear()
    assert SERVERS[1] in client.cut_out_servers
    del client._core.cut_out[SERVERS[1]]
    assert client.cut_out_servers == {}
    blocking = BlockingInferenceClient("router:1", SERVERS)
    blocking.async_client._core.cut_out[SERVERS[0]] = "DEADLINE_EXCEEDED"
    assert blocking.cut_out_servers == {SERVERS[0]: "DEADLINE_EXCEEDED"}
