"""The stack off one host: engine servers on hosts of their own (network namespaces on a bridge,
each link shaped: ``testbed``), the trainer on another, every process of the test inside a
host. Weight updates relayed across hosts down the relay trees commit exactly the pushed
weights, full and delta, what a fresh server started from them serves; a relaying host killed
mid-update leaves the fleet on one version, and back, it catches up to it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skyrl_grpc.tiny_model import ensure_tiny_model
from testbed import Host, Testbed
from testbed.stack import Process, job_result, run_job, start_job, start_router, start_server
from tests.helpers.hosts import ENGINE_FLAGS, JOB_SECONDS, RATE_MBIT, open_testbed
from tests.helpers.waits import until

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SERVERS = 4
HTTP_PORT = 8000
TEXTS = ["Hello world", "naïve café, 1234 résumé", "emoji 🙂 and 中文 text", "tabs\tand\nlines"]


@dataclass
class Fleet:
    bed: Testbed
    trainer: Host
    hosts: list[Host]
    servers: list[Process]
    addresses: list[str]
    spare: Host
    router: Process
    logs: Path

    @property
    def edge(self) -> str:
        return f"http://{self.router.host.address}:{HTTP_PORT}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("multihost-logs")
    with open_testbed() as bed:
        trainer = bed.add_host("trainer", RATE_MBIT)
        hosts = [bed.add_host(f"s{i}", RATE_MBIT) for i in range(SERVERS)]
        spare = bed.add_host("spare", RATE_MBIT)
        servers = [start_server(host, *ENGINE_FLAGS, log_dir=logs) for host in hosts]
        addresses = [server.until("ready")["address"] for server in servers]
        # The router on a host of its own, told nothing of the model's files.
        router = start_router(
            bed.add_host("router", RATE_MBIT),
            addresses,
            "--http-port",
            str(HTTP_PORT),
            log_dir=logs,
        )
        router.until("ready")
        yield Fleet(bed, trainer, hosts, servers, addresses, spare, router, logs)


def update(fleet: Fleet, steps: list[dict[str, object]], **extra: object) -> dict[str, Any]:
    arguments = {"servers": fleet.addresses, "model": str(ensure_tiny_model()), "steps": steps}
    return run_job(fleet.trainer, "update", {**arguments, **extra}, timeout=JOB_SECONDS)


def test_full_and_delta_updates_across_hosts_are_bit_identical_to_a_fresh_server(
    fleet: Fleet, tmp_path: Path
) -> None:
    saved = tmp_path / "pushed-model"
    # The first update has no base: whole weights; the second a delta against it.
    result = update(fleet, [{"edit": 1}, {"edit": 2}], save=str(saved))
    full, delta = result["steps"]
    for step in (full, delta):
        assert step["relayed"], step
        assert step["served"] == dict.fromkeys(fleet.addresses, step["pushed"])  # every tensor
        assert step["bytes_sent"] <= 1.05 * max(step["bytes_received"].values())  # sent once
    assert set(delta["bytes_received"].values()) == {max(delta["bytes_received"].values())}
    assert 0 < max(delta["bytes_received"].values()) < 0.2 * max(full["bytes_received"].values())
    # A server started from the pushed weights serves the same bytes.
    fresh = start_server(fleet.spare, "--model", str(saved), *ENGINE_FLAGS, log_dir=fleet.logs)
    try:
        address = fresh.until("ready")["address"]
        sums = run_job(fleet.spare, "checksums", {"servers": [address]}, timeout=JOB_SECONDS)
    finally:
        fleet.spare.kill()
    assert sums["checksums"][address] == delta["served"][fleet.addresses[0]]


async def test_a_relaying_host_killed_mid_update_leaves_one_version_and_catches_up(
    fleet: Fleet,
) -> None:
    """kill -9 of every process on a host that forwards in a relay tree, while the update
    streams: the update fails naming it, every other server serves the version before; back,
    it catches up from its peers to that version, and the next update reaches all four."""
    bed, model = fleet.bed, str(ensure_tiny_model())
    before = update(fleet, [{"edit": 3, "delta": False}], checksums=False)["versions"]
    assert len(set(before.values())) == 1
    # Host 2 forwards in the first tree (the hosts 0, 2, ... do): slow links, so the update
    # lasts seconds and the host dies in the middle of it.
    victim, victim_host = fleet.addresses[2], fleet.hosts[2]
    for host in (fleet.trainer, *fleet.hosts):
        bed.shape(host, 8)
    try:
        start = bed.received_bytes(victim_host)
        job = start_job(
            fleet.trainer,
            "update",
            {
                "servers": fleet.addresses,
                "model": model,
                "steps": [{"edit": 4, "delta": False}],
                "checksums": False,
            },
            log_dir=fleet.logs,
        )
        # Killed once a third of the model's 3.3 MB reached it.
        await until(
            lambda: bed.received_bytes(victim_host) - start > 1 << 20,
            timeout=JOB_SECONDS,
            what="a third of the update to reach the relaying host",
        )
        victim_host.kill()
        result = await asyncio.to_thread(job_result, job, JOB_SECONDS)
    finally:
        for host in (fleet.trainer, *fleet.hosts):
            bed.shape(host, RATE_MBIT)
    (step,) = result["steps"]
    assert "error" in step and victim in step["error"], step
    live = {a: v for a, v in result["versions"].items() if a != victim}
    assert set(live.values()) == set(before.values()), (live, before)  # one version: the old
    # Back on its host, it reads the fleet's weights from a peer before it serves.
    peers = ",".join(a for a in fleet.addresses if a != victim)
    fleet.servers[2] = start_server(
        victim_host, *ENGINE_FLAGS, "--catch-up-from", peers, log_dir=fleet.logs
    )
    fleet.servers[2].until("ready")
    sums = run_job(fleet.trainer, "checksums", {"servers": fleet.addresses}, timeout=JOB_SECONDS)
    assert len(set(sums["versions"].values())) == 1, sums["versions"]
    assert len({json.dumps(s, sort_keys=True) for s in sums["checksums"].values()}) == 1
    after = update(fleet, [{"edit": 5, "delta": False}], checksums=False)
    assert len(set(after["versions"].values())) == 1 and not after["steps"][0].get("error")


def test_a_router_on_a_host_without_the_models_files_tokenizes_as_the_servers_do(
    fleet: Fleet,
) -> None:
    """Text prompts through the edge of a router started without --tokenizer on a host of its
    own: the ids are a server's, and the router made them itself, with the tokenizer a server
    handed over (its log says so; it checked it against a server's first)."""
    arguments = {"edge": fleet.edge, "server": fleet.addresses[1], "texts": TEXTS}
    ids = run_job(fleet.trainer, "prompt_ids", arguments, timeout=JOB_SECONDS)
    assert ids["edge"] == ids["server"]
    log = (fleet.logs / "router-router.log").read_text()
    assert "the router tokenizes with the tokenizer a server handed over" in log
    assert "text prompts are tokenized in the router (same ids as the servers')" in log
