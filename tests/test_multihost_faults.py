"""Faults only a network has, on the testbed (hosts as network namespaces): a client, a router
and two server hosts, greedy streams through the router, each with a session of its own. A
server host cut off from the router (every packet between them dropped, no connection reset)
costs its streams no token, lost or repeated: the router notices within its backend liveness
(keepalive pings every second, an answer within one) and moves them to the other server with
their tokens so far; healed, the host serves again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testbed import Host, Testbed
from testbed.stack import job_result, run_job, start_job, start_router, start_server
from tests.helpers.hosts import ENGINE_FLAGS, JOB_SECONDS, RATE_MBIT, open_testbed

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TOKENS = 200
STREAMS = 8
# The router's backend liveness (its default): a stream on a host cut off waits this long,
# then as long as its continuation takes to start elsewhere. The bound below adds a second for
# a machine as busy as CI's.
LIVENESS_SECONDS = 2.0
STALL_BOUND = LIVENESS_SECONDS + 1.0


@dataclass
class FaultFleet:
    bed: Testbed
    client: Host
    router_host: Host
    servers: list[Host]
    addresses: list[str]
    router: str
    logs: Path


@pytest.fixture(scope="module")
def fault_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFleet]:
    logs = tmp_path_factory.mktemp("multihost-faults-logs")
    with open_testbed() as bed:
        client = bed.add_host("client", RATE_MBIT)
        router_host = bed.add_host("router", RATE_MBIT)
        servers = [bed.add_host(f"s{i}", RATE_MBIT) for i in range(2)]
        started = [start_server(host, *ENGINE_FLAGS, log_dir=logs) for host in servers]
        addresses = [server.until("ready")["address"] for server in started]
        router = start_router(router_host, addresses, log_dir=logs)
        router.until("ready")
        yield FaultFleet(bed, client, router_host, servers, addresses, router.address, logs)


def reference(fleet: FaultFleet) -> list[int]:
    """The greedy answer, from a short undisturbed run."""
    job = {"address": fleet.router, "streams": 1, "tokens": TOKENS, "seconds": 0.1}
    (call,) = run_job(fleet.client, "streams", job, timeout=JOB_SECONDS)["calls"]
    assert call["error"] is None and len(call["tokens"]) == TOKENS, call
    tokens: list[int] = call["tokens"]
    return tokens


async def test_a_server_host_cut_off_from_the_router_loses_no_token_and_streams_move_in_seconds(
    fault_fleet: FaultFleet,
) -> None:
    fleet, expected = fault_fleet, reference(fault_fleet)
    job = start_job(
        fleet.client,
        "streams",
        {"address": fleet.router, "streams": STREAMS, "tokens": TOKENS, "seconds": 25},
        log_dir=fleet.logs,
    )
    assert job.stdout is not None
    line = await asyncio.to_thread(job.stdout.readline)
    assert line.strip() == "PROGRESS streaming", line
    victim = fleet.servers[0]
    fleet.bed.cut_between(fleet.router_host, victim)
    try:
        await asyncio.sleep(10)  # the partition's length (the fault, not a wait on an event)
    finally:
        fleet.bed.heal_between(fleet.router_host, victim)
    calls = (await asyncio.to_thread(job_result, job, JOB_SECONDS))["calls"]
    failed = [c for c in calls if c["error"] is not None]
    assert not failed, failed
    assert all(c["tokens"] == expected for c in calls)  # none lost, none repeated
    stalls = sorted(c["max_gap"] for c in calls)
    assert stalls[-1] <= STALL_BOUND, stalls
    # Streams ran through the partition (some on the host cut off, which stalled and moved).
    assert stalls[-1] >= LIVENESS_SECONDS / 2, stalls
