"""Faults only a network has, on the testbed (hosts as network namespaces): a client, a trainer,
a router and two server hosts, greedy streams through the router, each with a session of its
own, and weight updates from the trainer. A
server host cut off from the router (every packet between them dropped, no connection reset)
costs its streams no token, lost or repeated: the router notices within its backend liveness
(keepalive pings every second, an answer within one) and moves them to the other server with
their tokens so far; healed, the host serves again. The workload's history (every call, each
message's tokens and counts) is read by ``testbed.history.check``: nothing lost or repeated,
no call past its deadline, sessions moved only off the host cut off. A server cut off from the
trainer in the middle of an update (shorter than the client's keepalive) is waited for, and so
are two servers cut off from each other while they relay it: the update commits on every
server, late by about the partition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skyrl_grpc.tiny_model import ensure_tiny_model
from testbed import Host, Testbed
from testbed.history import History, Outage, check
from testbed.stack import job_result, run_job, start_job
from tests.helpers.hosts import JOB_SECONDS, RATE_MBIT, host_fleet, open_testbed
from trainer_client import cut_out

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TOKENS = 200
STREAMS = 8
# The router's backend liveness (its default): a stream on a host cut off waits this long,
# then as long as its continuation takes to start elsewhere. The bound below adds two seconds
# for a machine as busy as CI's (the longest wait: 1.6 and 2.4 s in two runs alone, 3.7 s in
# one clean-clone run beside the other test worker's engine).
LIVENESS_SECONDS = 2.0
STALL_BOUND = LIVENESS_SECONDS + 2.0
# Each call's deadline: a stream of TOKENS takes a few seconds; one wedged by the cut would not
# end within it.
DEADLINE_SECONDS = 30.0
# Seconds from the heal until the router places sessions on the host again (its health checks
# run every second; a lost connection reconnects with gRPC's backoff, first retry within 1 s).
# 2.5 s measured alone; the bound leaves room for a machine busy with other engines, where
# each probe (a job process started inside the client host) takes seconds to start.
HEAL_BOUND = 60.0


# The trainer's link while it updates: slow enough that the update's transfer lasts seconds
# (the tiny model's 3.3 MB in ~7 s), so a partition lands in its middle.
TRAINER_MBIT = 4.0
# Shorter than the client's keepalive (a ping every 10 s, 5 s for its answer), which would
# give the connection up.
PARTITION_SECONDS = 5.0
# What waiting out a partition may add beyond its length: TCP's retransmission backoff (the
# first segment after the heal goes out at the next doubling, up to ~3 s after a 5 s cut) and
# a busy machine's second.
PARTITION_SLACK_SECONDS = 5.0


# A partition longer than the update may take (fault (g)): its timeout, the seconds a send or
# an answer may wait, runs out in the partition's middle.
LONG_PARTITION_SECONDS = 20.0
UPDATE_TIMEOUT_SECONDS = 8.0
# How long the trainer keeps trying after the failed update (past the partition's end).
RETRY_SECONDS = 60.0

# The router's OpenAI edge, on its host.
HTTP_PORT = 8000
# The router host's whole link down (fault (e)): shorter than the client's keepalive.
ROUTER_DOWN_SECONDS = 5.0


@dataclass
class FaultFleet:
    bed: Testbed
    client: Host
    trainer: Host
    router_host: Host
    servers: list[Host]
    addresses: list[str]
    router: str
    logs: Path

    @property
    def edge(self) -> str:
        return f"http://{self.router_host.address}:{HTTP_PORT}"


@pytest.fixture(scope="module")
def fault_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFleet]:
    logs = tmp_path_factory.mktemp("multihost-faults-logs")
    with open_testbed() as bed:
        hosted = host_fleet(bed, logs, http_port=HTTP_PORT)
        yield FaultFleet(
            bed,
            hosted.client,
            hosted.trainer,
            hosted.router_host,
            hosted.servers,
            hosted.addresses,
            hosted.router,
            logs,
        )


def reference(fleet: FaultFleet) -> list[int]:
    """The greedy answer, from a short undisturbed run."""
    job = {"address": fleet.router, "streams": 1, "tokens": TOKENS, "seconds": 0.1}
    history = History.from_json(run_job(fleet.client, "streams", job, JOB_SECONDS)["history"])
    assert check(history) == [], check(history)
    (call,) = history.calls
    assert call.status == "OK" and len(call.tokens) == TOKENS, call
    return call.tokens


async def serves_again(fleet: FaultFleet, server: str, healed: float) -> float:
    """Seconds from ``healed`` until the router places a fresh session on ``server`` (bounded:
    HEAL_BOUND)."""
    for attempt in range(60):
        job = {"address": fleet.router, "streams": 8, "tokens": 4, "seconds": 0.1}
        job["prefix"] = f"h{attempt}"  # fresh sessions, placed anew
        result = await asyncio.to_thread(run_job, fleet.client, "streams", job, JOB_SECONDS)
        history = History.from_json(result["history"])
        if any(call.server == server for call in history.calls):
            return time.monotonic() - healed
        if time.monotonic() - healed > HEAL_BOUND:
            break
    raise AssertionError(f"{server} took no session within {HEAL_BOUND} s of the heal")


async def test_a_server_host_cut_off_from_the_router_loses_no_token_and_streams_move_in_seconds(
    fault_fleet: FaultFleet,
) -> None:
    fleet, expected = fault_fleet, reference(fault_fleet)
    job = start_job(
        fleet.client,
        "streams",
        {
            "address": fleet.router,
            "streams": STREAMS,
            "tokens": TOKENS,
            "seconds": 25,
            "expected": expected,
            "deadline": DEADLINE_SECONDS,
        },
        log_dir=fleet.logs,
    )
    assert job.stdout is not None
    line = await asyncio.to_thread(job.stdout.readline)
    assert line.strip() == "PROGRESS streaming", line
    victim = fleet.servers[0]
    cut_at = time.monotonic()  # the hosts share this machine's monotonic clock
    fleet.bed.cut_between(fleet.router_host, victim)
    try:
        await asyncio.sleep(10)  # the partition's length (the fault, not a wait on an event)
    finally:
        fleet.bed.heal_between(fleet.router_host, victim)
    outage = Outage(fleet.addresses[0], cut_at, time.monotonic())
    # Healed, the host takes new sessions again (the router places some of 8 fresh ones on it
    # while the streams moved off it still run on the other).
    healed_in = await serves_again(fleet, fleet.addresses[0], outage.end)
    result = await asyncio.to_thread(job_result, job, JOB_SECONDS)
    history = History.from_json(result["history"])
    history.outages.append(outage)
    # None lost or repeated (each message's count, each call against the undisturbed answer),
    # every call OK within its deadline, sessions moved only off the host cut off.
    assert [str(v) for v in check(history)] == []
    assert all(call.status == "OK" for call in history.calls)
    stalls = sorted(result["max_gaps"])
    print(f"longest stall {stalls[-1]:.2f} s; serving again {healed_in:.1f} s after the heal")
    assert stalls[-1] <= STALL_BOUND, stalls
    # Streams ran through the partition (some on the host cut off, which stalled and moved).
    assert stalls[-1] >= LIVENESS_SECONDS / 2, stalls


async def test_a_server_cut_off_from_a_self_routing_trainer_loses_no_token_and_moves_in_seconds(
    fault_fleet: FaultFleet,
) -> None:
    """Fault (b)'s cut on the data path: a trainer's client sends its generations straight to
    the server the router's policy picks (its default), and one server host is partitioned
    from the trainer's host for 10 s while the router still reaches it (its view keeps the
    server). The client's generation channel loses the server within its liveness
    (``direct_liveness_seconds``, 2 s), each generation on it moves to the other server with
    its tokens so far, and new ones avoid it meanwhile: every answer equals the undisturbed
    one, and no call takes much longer than the liveness plus the slowest undisturbed one on
    the other server's doubled load. Calls carry no session here, so the generations moved are
    checked by their answers, not by where their sessions went."""
    fleet, expected = fault_fleet, reference(fault_fleet)
    arguments = {
        "router": fleet.router,
        "servers": fleet.addresses,
        # No session: each call goes to the server with the least in flight, so both servers
        # run some when the cut comes (sessions would follow the load earlier tests left).
        "sessions": False,
        "streams": STREAMS,
        "tokens": TOKENS,
        "seconds": 25,
        "expected": expected,
        "deadline": DEADLINE_SECONDS,
    }
    job = start_job(fleet.trainer, "generations", arguments, log_dir=fleet.logs)
    assert job.stdout is not None
    line = await asyncio.to_thread(job.stdout.readline)
    assert line.strip() == "PROGRESS streaming", line
    cut_at = time.monotonic()
    fleet.bed.cut_between(fleet.trainer, fleet.servers[1])
    try:
        await asyncio.sleep(10)  # the partition's length (the fault, not a wait on an event)
    finally:
        fleet.bed.heal_between(fleet.trainer, fleet.servers[1])
    outage = Outage(fleet.addresses[1], cut_at, time.monotonic())
    result = await asyncio.to_thread(job_result, job, JOB_SECONDS)
    history = History.from_json(result["history"])
    history.outages.append(outage)
    assert [str(v) for v in check(history)] == []
    assert all(call.status == "OK" for call in history.calls)
    durations = list(zip(history.calls, result["max_gaps"], strict=True))
    before = [d for call, d in durations if call.ended < cut_at]
    through = [d for call, d in durations if call.started < outage.end and call.ended > cut_at]
    print(
        f"direct path: {len(history.calls)} generations; the longest before the cut "
        f"{max(before):.2f} s, through it {max(through):.2f} s"
    )
    assert before and through, (before, through)
    # The liveness, then the rest of the call on the other server, which now runs both
    # servers' calls and the moved ones' prompts again: up to twice the slowest undisturbed
    # call, with 1.5 s for a busy machine (a clean-clone run: 4.11 s against 0.55 s before).
    # With the control channel's keepalive instead of the liveness it took 5.92 s. The liveness
    # is allowed twice: one clean-clone run took 7.98 s against 1.33 s before (not yet
    # explained; noted on issue 76), still well inside the 10 s partition.
    bound = 2 * LIVENESS_SECONDS + 2 * max(before) + 1.5
    assert max(through) <= bound, (before, through)
    # Generations ran on the server cut off: they waited for the liveness, then moved.
    assert max(through) >= LIVENESS_SECONDS / 2, (before, through)


async def test_streams_through_loss_and_distance_on_every_link_lose_nothing(
    fault_fleet: FaultFleet,
) -> None:
    """2% of packets dropped each way and 40 ms round trips between every two hosts for a
    whole run: TCP retransmits underneath, nothing a caller sees is lost, repeated or late."""
    fleet, expected = fault_fleet, reference(fault_fleet)
    hosts = [fleet.client, fleet.router_host, *fleet.servers]
    try:
        for host in hosts:
            fleet.bed.lose(host, 2.0)
            fleet.bed.delay(host, 20)  # each way: 40 ms between any two hosts
        job = {
            "address": fleet.router,
            "streams": STREAMS,
            "tokens": TOKENS,
            "seconds": 15,
            "expected": expected,
            "deadline": DEADLINE_SECONDS,
        }
        result = await asyncio.to_thread(run_job, fleet.client, "streams", job, JOB_SECONDS)
    finally:
        fleet.bed.heal_all()
    history = History.from_json(result["history"])
    assert [str(v) for v in check(history)] == []
    assert all(call.status == "OK" for call in history.calls)
    assert len(history.calls) >= STREAMS


def full_update(fleet: FaultFleet, edit: int) -> dict[str, object]:
    """An ``update`` job's arguments: the whole checkpoint with ``edit`` edits, to every server."""
    steps = [{"edit": edit, "delta": False}]
    return {"servers": fleet.addresses, "model": str(ensure_tiny_model()), "steps": steps}


@dataclass
class PartitionedUpdate:
    """A full update with two hosts partitioned from each other in its middle, and one before
    it undisturbed: each one's step, the versions after, when the cut began and healed."""

    before: dict[str, Any]
    step: dict[str, Any]
    versions: dict[str, int | None]
    cut_at: float
    healed_at: float

    @property
    def late(self) -> float:
        return float(self.step["seconds"] - self.before["seconds"])


async def update_through_partition(
    fleet: FaultFleet,
    a: Host,
    b: Host,
    seconds: float = PARTITION_SECONDS,
    options: dict[str, object] | None = None,
) -> PartitionedUpdate:
    """A full update over the trainer's slowed link, ``a`` and ``b`` partitioned from each
    other for ``seconds`` a second into its transfer, then healed (``options``: more
    ``update_weights`` arguments for the update in it)."""
    fleet.bed.shape(fleet.trainer, TRAINER_MBIT)
    try:
        undisturbed = await asyncio.to_thread(
            run_job, fleet.trainer, "update", full_update(fleet, 1), JOB_SECONDS
        )
        arguments = {**full_update(fleet, 2), "update": options or {}}
        job = start_job(fleet.trainer, "update", arguments, log_dir=fleet.logs)
        assert job.stdout is not None
        line = await asyncio.to_thread(job.stdout.readline)
        assert line.strip() == "PROGRESS step 0 begins", line
        # Into the transfer (an undisturbed one takes seconds; asserted from the job's own
        # clock by the callers).
        await asyncio.sleep(1.0)
        cut_at = time.monotonic()
        fleet.bed.cut_between(a, b)
        try:
            await asyncio.sleep(seconds)  # the partition's length (the fault)
        finally:
            fleet.bed.heal_between(a, b)
        healed_at = time.monotonic()
        result = await asyncio.to_thread(job_result, job, JOB_SECONDS)
    finally:
        fleet.bed.shape(fleet.trainer, RATE_MBIT)
    (before,) = undisturbed["steps"]
    (step,) = result["steps"]
    return PartitionedUpdate(before, step, result["versions"], cut_at, healed_at)


def assert_waited_out_on_one_version(fleet: FaultFleet, update: PartitionedUpdate) -> None:
    step, versions = update.step, update.versions
    assert "error" not in step, step
    # The cut landed in the update, which went on past the heal: it waited the partition out.
    assert step["began"] < update.cut_at and step["ended"] > update.healed_at, update
    assert step["served"] == dict.fromkeys(fleet.addresses, step["pushed"])
    assert len(set(versions.values())) == 1 and None not in versions.values(), versions
    print(
        f"update {update.before['seconds']:.1f} s undisturbed, {step['seconds']:.1f} s with a "
        f"{PARTITION_SECONDS:.0f} s partition: {update.late:.1f} s later"
    )
    assert update.late <= PARTITION_SECONDS + PARTITION_SLACK_SECONDS, update


async def test_a_server_cut_off_from_the_trainer_mid_update_is_waited_for_on_one_version(
    fault_fleet: FaultFleet,
) -> None:
    """Fault (b): the trainer and one server partitioned from each other for 5 s in the middle
    of a full update (the server still reaches the other server and the router). The update's
    share sent straight to that server stalls, TCP retransmits after the heal, and the update
    commits on both servers: one version, every tensor as pushed, later than an undisturbed
    update by about the partition."""
    fleet = fault_fleet
    update = await update_through_partition(fleet, fleet.trainer, fleet.servers[1])
    assert_waited_out_on_one_version(fleet, update)


async def test_a_relay_parent_cut_off_from_its_child_mid_update_is_waited_for_on_one_version(
    fault_fleet: FaultFleet,
) -> None:
    """Fault (c): the two servers partitioned from each other for 5 s in the middle of a
    relayed full update. With two hosts each is the other's relay parent (one tree each):
    both forwarded shares stall, then so do the trainer's streams into them (each parent's
    queue to its child is full), TCP retransmits after the heal and the update commits on both
    servers, on one version, later by about the partition."""
    fleet = fault_fleet
    update = await update_through_partition(fleet, fleet.servers[0], fleet.servers[1])
    assert update.step["relayed"], update.step  # the partition cut the relay's own links
    assert_waited_out_on_one_version(fleet, update)


async def test_the_router_host_cut_off_under_edge_and_trainer_traffic_loses_nothing(
    fault_fleet: FaultFleet,
) -> None:
    """Fault (e): the router host's link drops everything for 5 s while an agent harness
    streams completions through its OpenAI edge (from the client host) and a trainer streams
    generations through it over gRPC (from the trainer host). Every connection through the
    router stalls; none may lose, repeat or wedge a token, and both kinds of call go on after
    the heal."""
    fleet, expected = fault_fleet, reference(fault_fleet)
    common = {"tokens": TOKENS, "seconds": 20, "expected": expected, "deadline": DEADLINE_SECONDS}
    edge_job = start_job(
        fleet.client, "edge", {"address": fleet.edge, "streams": 4, **common}, log_dir=fleet.logs
    )
    grpc_job = start_job(
        fleet.trainer,
        "streams",
        {"address": fleet.router, "streams": 4, "prefix": "trainer", **common},
        log_dir=fleet.logs,
    )
    for job in (edge_job, grpc_job):
        assert job.stdout is not None
        line = await asyncio.to_thread(job.stdout.readline)
        assert line.strip() == "PROGRESS streaming", line
    cut_at = time.monotonic()
    fleet.bed.cut(fleet.router_host)
    try:
        await asyncio.sleep(ROUTER_DOWN_SECONDS)  # the fault's length
    finally:
        fleet.bed.heal(fleet.router_host)
    healed_at = time.monotonic()
    for name, job in (("edge", edge_job), ("gRPC", grpc_job)):
        result = await asyncio.to_thread(job_result, job, JOB_SECONDS)
        history = History.from_json(result["history"])
        # The router could reach no server while it was cut off.
        history.outages += [Outage(a, cut_at, healed_at) for a in fleet.addresses]
        assert [str(v) for v in check(history)] == [], name
        # Every request answered whole in the end: the router holds what it cannot place
        # until a server is back (--hold-seconds); a call that still ends UNAVAILABLE (a
        # client's own keepalive giving up on the stalled connection) is retried by its
        # client, the same request, counted once.
        requests = {c.key for c in history.calls}
        assert requests == {c.key for c in history.calls if c.status == "OK"}, name
        retried = len(history.calls) - len(requests)
        after = [c for c in history.calls if c.started > healed_at and c.status == "OK"]
        assert after, f"no {name} call answered after the heal"
        print(
            f"{name}: {len(requests)} requests, {retried} retries; longest stall "
            f"{max(result['max_gaps']):.1f} s"
        )


async def test_a_partition_that_outlasts_the_update_ends_it_on_one_version_and_the_retry_commits(
    fault_fleet: FaultFleet,
) -> None:
    """Fault (g): the trainer and one server partitioned for longer than the update may take
    (its ``timeout``: a send or an answer waiting that long ends it), a second into a full
    update. The update fails at its timeout, naming that server, and is undone everywhere:
    every server keeps its previous version (the server cut off, whose cancellation cannot reach
    it, holds the half-received update). The trainer tries again every second: refused at once
    while the server is cut off, then, healed, the retry replaces that half-received update
    (the same trainer reopens its own update) and commits on both, one version, every tensor
    as pushed."""
    fleet = fault_fleet
    fleet.bed.shape(fleet.trainer, TRAINER_MBIT)
    try:
        arguments = full_update(fleet, 2)
        arguments["steps"] = [
            {"edit": 2, "delta": False, "update": {"timeout": UPDATE_TIMEOUT_SECONDS}},
            # The trainer's next try, again every second while it fails (a server cut off
            # refuses a new update at once).
            {"edit": 3, "delta": False, "retry_seconds": RETRY_SECONDS},
        ]
        arguments["keep_going"] = True
        job = start_job(fleet.trainer, "update", arguments, log_dir=fleet.logs)
        assert job.stdout is not None
        line = await asyncio.to_thread(job.stdout.readline)
        assert line.strip() == "PROGRESS step 0 begins", line
        await asyncio.sleep(1.0)  # into the transfer (an undisturbed one takes ~7 s)
        cut_at = time.monotonic()
        fleet.bed.cut_between(fleet.trainer, fleet.servers[1])
        try:
            await asyncio.sleep(LONG_PARTITION_SECONDS)  # the partition's length (the fault)
        finally:
            fleet.bed.heal_between(fleet.trainer, fleet.servers[1])
        healed_at = time.monotonic()
        result = await asyncio.to_thread(job_result, job, JOB_SECONDS)
    finally:
        fleet.bed.shape(fleet.trainer, RATE_MBIT)
    failed, retry = result["steps"]
    print(
        f"fault (g): failed {failed['ended'] - cut_at:.1f} s into a {LONG_PARTITION_SECONDS:.0f}"
        f" s partition ({UPDATE_TIMEOUT_SECONDS:.0f} s timeout); the retry committed "
        f"{retry.get('ended', 0) - healed_at:.1f} s after the heal"
    )
    assert "error" in failed, failed
    assert fleet.addresses[1] in failed["error"], failed
    assert "every server kept its previous weights" in failed["error"], failed
    # Ended by the update's timeout while still cut off, not by the partition's end.
    assert cut_at < failed["ended"] < healed_at, (failed, cut_at, healed_at)
    assert "error" not in retry, retry
    assert retry["ended"] > healed_at, (retry, healed_at)
    assert retry["served"] == dict.fromkeys(fleet.addresses, retry["pushed"])
    assert len(set(result["versions"].values())) == 1, result["versions"]


async def fresh_sessions(fleet: FaultFleet, prefix: str) -> History:
    """8 fresh sessions of a few tokens through the router, from the client host."""
    probe = {"address": fleet.router, "streams": 8, "tokens": 4, "seconds": 0.1, "prefix": prefix}
    placed = await asyncio.to_thread(run_job, fleet.client, "streams", probe, JOB_SECONDS)
    return History.from_json(placed["history"])


def assert_all_on(history: History, server: str, version: int) -> None:
    """Every call of ``history`` served by ``server``, every token at ``version``: the router
    kept them off a server behind it (one cut out), which it still reaches."""
    assert [str(v) for v in check(history)] == []
    served = {call.server for call in history.calls if call.status == "OK"}
    assert served == {server}, served
    versions = {m.weight_version for call in history.calls for m in call.messages if m.tokens}
    assert versions == {version}, versions


# Fault (g) with the cut-out: a partition longer than the update's timeout, the trainer's
# next step meanwhile, and one after the heal.
CUT_OUT_PARTITION_SECONDS = 40.0
CUT_OUT_TIMEOUT_SECONDS = 5.0
# Every control call's deadline in that job: a checksum or version asked of the server cut off
# would otherwise wait the client's default minute.
CUT_OUT_CONTROL_SECONDS = 10.0


async def test_a_server_cut_off_longer_than_the_update_is_cut_out_and_taken_back_after_the_heal(
    fault_fleet: FaultFleet,
) -> None:
    """Fault (g), the trainer's way: the trainer and one server partitioned for longer than the
    update may take, with ``cut_out_unreachable``. The update fails on that server at its
    timeout and runs again at once on the other, which commits: the trainer's step ends about
    one timeout and one transfer after the cut, not after the partition. The server cut off
    keeps its previous weights, and the router, which still reaches it, places no session on
    it (it is behind). The trainer's next step, still inside the partition, leaves it out
    after a short probe; the first step after the heal takes it back with the whole weights,
    and both servers serve one version, every tensor as pushed."""
    fleet = fault_fleet
    cut_server = fleet.addresses[1]
    healed_file = fleet.logs / "cut-out-healed"
    healed_file.unlink(missing_ok=True)
    options = {"cut_out_unreachable": True}
    arguments = full_update(fleet, 2)
    arguments["client"] = {"control_timeout": CUT_OUT_CONTROL_SECONDS}
    arguments["steps"] = [
        {"edit": 2, "delta": False, "checksums": False,
         "update": {**options, "timeout": CUT_OUT_TIMEOUT_SECONDS}},
        {"edit": 3, "checksums": False, "update": options},  # inside the partition
        {"edit": 4, "wait_for": str(healed_file), "update": options},  # after the heal
    ]  # fmt: skip
    fleet.bed.shape(fleet.trainer, TRAINER_MBIT)
    job = start_job(fleet.trainer, "update", arguments, log_dir=fleet.logs)
    try:
        assert job.stdout is not None
        line = await asyncio.to_thread(job.stdout.readline)
        assert line.strip() == "PROGRESS step 0 begins", line
        await asyncio.sleep(1.0)  # into the transfer (an undisturbed one takes ~7 s)
        cut_at = time.monotonic()
        fleet.bed.cut_between(fleet.trainer, fleet.servers[1])
        try:
            for step in (1, 2):  # both steps inside the partition ended
                line = await asyncio.to_thread(job.stdout.readline)
                assert line.strip() == f"PROGRESS step {step} begins", line
            inside = time.monotonic()
            # The router reaches the server cut off (only the trainer does not), which is behind:
            # fresh sessions all go to the other server, at the new weights.
            placed = await fresh_sessions(fleet, "cut-out")
            assert time.monotonic() < cut_at + CUT_OUT_PARTITION_SECONDS, "the steps took too long"
            await asyncio.sleep(max(0.0, cut_at + CUT_OUT_PARTITION_SECONDS - time.monotonic()))
        finally:
            fleet.bed.heal_between(fleet.trainer, fleet.servers[1])
        healed_at = time.monotonic()
        healed_file.touch()
        result = await asyncio.to_thread(job_result, job, JOB_SECONDS)
    finally:
        fleet.bed.shape(fleet.trainer, RATE_MBIT)
        if job.poll() is None:
            job.kill()
    cut, inside_step, after = result["steps"]
    print(
        f"cut-out: the step met by the cut ended {cut['ended'] - cut_at:.1f} s after it "
        f"({CUT_OUT_TIMEOUT_SECONDS:.0f} s timeout, {CUT_OUT_PARTITION_SECONDS:.0f} s "
        f"partition); the next {inside_step['seconds']:.1f} s; after the heal "
        f"{after['seconds']:.1f} s, {after['bytes_received'].get(cut_server, 0) / 1e6:.1f} MB "
        "to the server taken back"
    )
    for step in (cut, inside_step):
        assert "error" not in step, step
        assert list(step["cut_out"]) == [cut_server], step
        assert list(step["versions"]) == [fleet.addresses[0]], step
    assert cut["ended"] < inside < healed_at
    # The cut step: its timeout (a send, then an answer, may each wait it), a retry's transfer.
    assert cut["ended"] - cut_at < 4 * CUT_OUT_TIMEOUT_SECONDS + 15.0, cut
    assert_all_on(placed, fleet.addresses[0], inside_step["versions"][fleet.addresses[0]])
    # Taken back after the heal: the whole weights to it, the others a delta, one version.
    assert "error" not in after and "cut_out" not in after, after
    assert after["served"] == dict.fromkeys(fleet.addresses, after["pushed"])
    assert len(set(result["versions"].values())) == 1, result["versions"]
    assert after["bytes_received"][cut_server] > 10 * after["bytes_received"][fleet.addresses[0]]


# A partition a trainer's step begins in: it outlasts the step and the client's wait before it
# asks a server cut out again.
PAUSE_CUT_SECONDS = cut_out.ASK_AGAIN_SECONDS + 10.0


@pytest.mark.parametrize("pause", [True, False], ids=["at its pause", "at its update"])
async def test_a_trainer_step_whose_server_is_cut_off_before_it_goes_on_without_it(
    fault_fleet: FaultFleet, pause: bool
) -> None:
    """A partition that begins before a trainer's step, with ``ClientConfig.cut_out_unreachable``
    on: the step's pause reaches the other server at once and gives up on the one cut off when
    it answers no probe (2 s), the update leaves it out without waiting on it again and
    commits on the other, the resume too. Without a pause, the update's first question to each
    server does the same. The server cut off keeps its weights and gets no session while it is
    behind; the first step after the heal (pauses it again,) sends it the whole weights (and
    resumes it): one version, every tensor as pushed."""
    fleet = fault_fleet
    cut_server = fleet.addresses[1]
    cut_file, healed_file = fleet.logs / f"cut-{pause}", fleet.logs / f"healed-{pause}"
    for cue in (cut_file, healed_file):
        cue.unlink(missing_ok=True)
    arguments = full_update(fleet, 5)
    arguments["client"] = {"cut_out_unreachable": True, "control_timeout": CUT_OUT_CONTROL_SECONDS}
    arguments["steps"] = [
        {"edit": 5, "delta": False, "pause": pause, "wait_for": str(cut_file), "checksums": False},
        {"edit": 6, "pause": pause, "wait_for": str(healed_file)},
    ]
    fleet.bed.shape(fleet.trainer, TRAINER_MBIT)
    job = start_job(fleet.trainer, "update", arguments, log_dir=fleet.logs)
    try:
        assert job.stdout is not None
        line = await asyncio.to_thread(job.stdout.readline)
        assert line.strip() == "PROGRESS step 0 begins", line
        cut_at = time.monotonic()
        fleet.bed.cut_between(fleet.trainer, fleet.servers[1])
        try:
            cut_file.touch()  # the step begins inside the partition
            line = await asyncio.to_thread(job.stdout.readline)
            assert line.strip() == "PROGRESS step 1 begins", line
            inside = time.monotonic()
            placed = await fresh_sessions(fleet, f"cut-{pause}")
            # The rest of the partition (the fault's length): long enough that the client asks
            # the server cut off again at the first step after the heal.
            await asyncio.sleep(max(0.0, cut_at + PAUSE_CUT_SECONDS - time.monotonic()))
        finally:
            fleet.bed.heal_between(fleet.trainer, fleet.servers[1])
        healed_at = time.monotonic()
        healed_file.touch()
        result = await asyncio.to_thread(job_result, job, JOB_SECONDS)
    finally:
        fleet.bed.shape(fleet.trainer, RATE_MBIT)
        if job.poll() is None:
            job.kill()
    cut, after = result["steps"]
    undisturbed = result["steps"][1]["seconds"]
    print(
        f"a step begun {cut['began'] - cut_at:.1f} s into a partition: {cut['seconds']:.1f} s "
        f"({'pause, ' if pause else ''}full update{', resume' if pause else ''}) without the "
        "server cut off; the step after the heal "
        f"{after['seconds']:.1f} s, {after['bytes_received'].get(cut_server, 0) / 1e6:.1f} MB "
        "to the server taken back"
    )
    assert "error" not in cut, cut
    if pause:
        assert cut["paused"] == cut["resumed"] == [fleet.addresses[0]], cut
    assert list(cut["cut_out"]) == [cut_server] and list(cut["versions"]) == [fleet.addresses[0]]
    assert cut["ended"] < inside < healed_at
    # Its pause (or its update's first question) waited one probe for the server cut off, the
    # rest of the step none.
    probe_seconds = cut_out.FIRST_PROBE_AFTER_SECONDS + cut_out.PROBE_SECONDS
    assert cut["seconds"] < undisturbed + probe_seconds + 3.0, (cut, undisturbed)
    assert_all_on(placed, fleet.addresses[0], cut["versions"][fleet.addresses[0]])
    assert "error" not in after and "cut_out" not in after, after
    if pause:  # paused again (unless it answered after the pause's wait: then at the update)
        assert after["resumed"] == fleet.addresses, after
        assert fleet.addresses[0] in after["paused"], after
    assert after["served"] == dict.fromkeys(fleet.addresses, after["pushed"])
    assert len(set(result["versions"].values())) == 1, result["versions"]
