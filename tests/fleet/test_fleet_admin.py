"""FleetAdmin, the running fleet's Scale verb, over a real gRPC socket: the rule (at least one
server, one Scale at a time, a failed start named with what the fleet is now), the token, and
`skyrl-grpc scale` on the command line. The fleet here is a stand-in (the subject is the verb);
``tests/engine/test_lifecycle.py`` scales a real ``up`` through it."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from servers.fleet import FleetAddresses
from servers.fleet.admin import FleetScaler, serve
from skyrl_grpc.process_group import free_port
from trainer_client import FleetAdminClient, FleetAdminError

ROOT = Path(__file__).resolve().parents[2]


class StandInFleet:
    """Addresses that grow and shrink as asked; ``hold`` keeps a Scale running until set."""

    def __init__(self) -> None:
        self.addresses = FleetAddresses("127.0.0.1:1", ("127.0.0.1:2", "127.0.0.1:3"), ())
        self.hold = threading.Event()
        self.hold.set()
        self.started = threading.Event()
        self.fail_at: int | None = None

    def scale(self, count: int) -> FleetAddresses:
        self.started.set()
        self.hold.wait(30)
        servers = list(self.addresses.servers)
        while len(servers) < count:
            if len(servers) == self.fail_at:
                self.addresses = FleetAddresses(self.addresses.router, tuple(servers), ())
                raise RuntimeError(f"server {len(servers)} failed to start")
            servers.append(f"127.0.0.1:{2 + len(servers)}")
        del servers[count:]
        self.addresses = FleetAddresses(self.addresses.router, tuple(servers), ())
        return self.addresses


@pytest.fixture
def fleet() -> Iterator[tuple[StandInFleet, str]]:
    stand_in = StandInFleet()
    server, port = serve(FleetScaler(stand_in.scale, lambda: stand_in.addresses), "127.0.0.1", 0)
    yield stand_in, f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_scale_grows_and_shrinks_and_lists_the_members(fleet: tuple[StandInFleet, str]) -> None:
    _, address = fleet
    with FleetAdminClient(address) as client:
        grown = client.scale(4)
        assert grown.servers == ("127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4", "127.0.0.1:5")
        assert grown.router == "127.0.0.1:1"
        assert client.members() == grown
        assert client.scale(1).servers == ("127.0.0.1:2",)


def test_fewer_than_one_server_is_refused(fleet: tuple[StandInFleet, str]) -> None:
    _, address = fleet
    with FleetAdminClient(address) as client, pytest.raises(FleetAdminError) as refused:
        client.scale(0)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at least one serving server" in str(refused.value)


def test_a_second_scale_while_one_runs_is_aborted(fleet: tuple[StandInFleet, str]) -> None:
    stand_in, address = fleet
    stand_in.hold.clear()
    with FleetAdminClient(address) as first, FleetAdminClient(address) as second:
        running = threading.Thread(target=first.scale, args=(3,))
        running.start()
        assert stand_in.started.wait(30)
        with pytest.raises(FleetAdminError) as refused:
            second.scale(4)
        assert refused.value.code == grpc.StatusCode.ABORTED
        stand_in.hold.set()
        running.join(30)
        assert len(second.members().servers) == 3


def test_a_server_that_fails_to_start_is_named_with_what_the_fleet_is_now(
    fleet: tuple[StandInFleet, str],
) -> None:
    stand_in, address = fleet
    stand_in.fail_at = 3
    with FleetAdminClient(address) as client:
        with pytest.raises(FleetAdminError) as failed:
            client.scale(5)
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        assert "server 3 failed to start" in str(failed.value)
        assert "now 3 servers" in str(failed.value)
        assert len(client.members().servers) == 3  # what started stays


def test_with_a_token_a_call_without_it_is_refused() -> None:
    stand_in = StandInFleet()
    scaler = FleetScaler(stand_in.scale, lambda: stand_in.addresses)
    server, port = serve(scaler, "127.0.0.1", 0, token="s3cret")
    try:
        with FleetAdminClient(f"127.0.0.1:{port}") as anonymous:
            with pytest.raises(FleetAdminError) as refused:
                anonymous.scale(3)
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "--admin-token" in str(refused.value)
        assert len(stand_in.addresses.servers) == 2
        with FleetAdminClient(f"127.0.0.1:{port}", token="s3cret") as admin:
            assert len(admin.scale(3).servers) == 3
    finally:
        server.stop(grace=None)


def test_the_scale_command_prints_the_fleet_or_says_why_not(
    fleet: tuple[StandInFleet, str],
) -> None:
    _, address = fleet

    def scale(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "servers.cli", "scale", *argv, "--fleet", address]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)

    grown = scale("3")
    assert grown.returncode == 0, grown.stderr
    assert grown.stdout.splitlines() == [
        "server 0: 127.0.0.1:2",
        "server 1: 127.0.0.1:3",
        "server 2: 127.0.0.1:4",
    ]
    refused = scale("0")
    assert refused.returncode == 1
    assert refused.stderr.strip().startswith("skyrl-grpc scale: INVALID_ARGUMENT:"), refused.stderr
    # Nothing at the address: the flag `up` was to be started with, named.
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "servers.cli", "scale", "3", "--fleet", f"127.0.0.1:{port}"]
    nobody = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert nobody.returncode == 1 and "UNAVAILABLE" in nobody.stderr
    assert f"skyrl-grpc up --admin-port {port}" in nobody.stderr, nobody.stderr
