"""What the tests on the testbed (``testbed``: hosts as network namespaces) share: the testbed
itself, refused where the machine cannot host one, and the engines' settings there."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from testbed import Host, Testbed, TestbedUnavailable
from testbed.stack import start_router, start_server

# Each host's link, both ways.
RATE_MBIT = 200
# Engines share this machine: a small KV cache each, the tiny model's default, also for a
# server started on a saved copy of it (any other model's default is 1 GiB).
ENGINE_FLAGS = ("--kv-cache-gib", "0.125")
# Seconds a job on a host may take.
JOB_SECONDS = 300


def open_testbed() -> Testbed:
    """A testbed; skipped without root (a developer's machine), failed as root without the
    tools (scripts/setup.sh did not run)."""
    try:
        return Testbed()
    except TestbedUnavailable as unavailable:
        if "root" in str(unavailable):
            pytest.skip(str(unavailable))
        raise


@dataclass
class HostedFleet:
    """The fleet most fault tests run: a client, a trainer and a router on hosts of their own,
    a server on each of ``servers`` hosts (``addresses``, in order)."""

    client: Host
    trainer: Host
    router_host: Host
    servers: list[Host]
    addresses: list[str]
    router: str

    def restart(self, host: Host, logs: Path) -> None:
        """The server of ``host`` (killed) started again, reading its peers' weights before
        it serves; returns once it is ready."""
        index = self.servers.index(host)
        peers = ",".join(a for i, a in enumerate(self.addresses) if i != index)
        flags = (*ENGINE_FLAGS, "--seed", str(index), "--catch-up-from", peers)
        start_server(host, *flags, log_dir=logs).until("ready")


def host_fleet(bed: Testbed, logs: Path, servers: int = 2, http_port: int = 8000) -> HostedFleet:
    """``HostedFleet`` on ``bed``: every server ready, the router (its OpenAI edge on
    ``http_port``) ready in front of them."""
    client = bed.add_host("client", RATE_MBIT)
    trainer = bed.add_host("trainer", RATE_MBIT)
    router_host = bed.add_host("router", RATE_MBIT)
    hosts = [bed.add_host(f"s{i}", RATE_MBIT) for i in range(servers)]
    # Each with a seed of its own, as an operator starting servers by hand should give them
    # (docs/serving.md) and as ``up`` does: alike seeds sample alike.
    started = [
        start_server(host, *ENGINE_FLAGS, "--seed", str(i), log_dir=logs)
        for i, host in enumerate(hosts)
    ]
    addresses = [server.until("ready")["address"] for server in started]
    router = start_router(router_host, addresses, "--http-port", str(http_port), log_dir=logs)
    router.until("ready")
    return HostedFleet(client, trainer, router_host, hosts, addresses, router.address)
