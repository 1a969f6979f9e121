"""TLS across hosts (the testbed: each server on a host of its own): clients and relaying
servers verify each server's address against its certificate. Two servers whose certificate
names their addresses take a relayed update over TLS (the servers relay to each other over
gRPC with TLS, verifying each other), bit-identical to the pushed weights; a server on a host
its certificate does not name is refused by the client, which names it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from skyrl_grpc.tiny_model import ensure_tiny_model
from testbed import Host
from testbed.stack import run_job, start_server
from tests.helpers.certs import Certificates, make_certificates
from tests.helpers.hosts import ENGINE_FLAGS, JOB_SECONDS, RATE_MBIT, open_testbed

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@dataclass
class TlsFleet:
    trainer: Host
    named: list[str]  # servers whose certificate names their host's address
    misnamed: str  # a server on a host its certificate does not name
    certs: Certificates

    @property
    def client(self) -> dict[str, object]:
        return {"tls": {"root_certificates": self.certs.ca}}


@pytest.fixture(scope="module")
def tls_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsFleet]:
    logs = tmp_path_factory.mktemp("multihost-tls-logs")
    with open_testbed() as bed:
        trainer = bed.add_host("trainer", RATE_MBIT)
        hosts = [bed.add_host(f"s{i}", RATE_MBIT) for i in range(3)]
        # One certificate for the first two hosts' addresses; the third host serves it too.
        certs = make_certificates(
            tmp_path_factory.mktemp("certs"), tuple(h.address for h in hosts[:2])
        )
        tls = ["--tls-cert", certs.server_cert, "--tls-key", certs.server_key]
        peers = ["--peer-tls-ca", certs.ca]
        servers = [start_server(h, *ENGINE_FLAGS, *tls, *peers, log_dir=logs) for h in hosts]
        addresses = [server.until("ready")["address"] for server in servers]
        yield TlsFleet(trainer, addresses[:2], addresses[2], certs)


def test_an_update_relayed_over_tls_across_hosts_lands_whole(tls_fleet: TlsFleet) -> None:
    arguments = {
        "servers": tls_fleet.named,
        "model": str(ensure_tiny_model()),
        "steps": [{"edit": 1}],
        "client": tls_fleet.client,
    }
    result = run_job(tls_fleet.trainer, "update", arguments, timeout=JOB_SECONDS)
    (step,) = result["steps"]
    assert "error" not in step, step
    assert step["relayed"] and step["served"] == dict.fromkeys(tls_fleet.named, step["pushed"])


def test_a_server_whose_certificate_names_another_host_is_refused(tls_fleet: TlsFleet) -> None:
    servers = [tls_fleet.named[0], tls_fleet.misnamed]
    found = run_job(
        tls_fleet.trainer, "info", {"servers": servers, "client": tls_fleet.client}, JOB_SECONDS
    )
    assert "version" in found[tls_fleet.named[0]], found
    refused = found[tls_fleet.misnamed]["error"]
    assert "UNAVAILABLE" in refused and tls_fleet.misnamed in refused, refused
    assert "Hostname Verification Check failed" in refused, refused
    # What to do about it, in the client's words.
    assert "certificate does not name" in refused and "server_name_override" in refused
