"""``skyrl-grpc up --gateway smg``: SMG, the Rust gateway, started in front of the fleet and kept
current as it changes (a server added, one killed and restarted, one removed), serving
completions through each change; refused in one line where it could not reach the servers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from servers.fleet.gateway import worker_url
from skyrl_grpc.metadata import SESSION_ID
from tests.helpers.server_process import ROOT
from tests.helpers.up_process import Up
from tests.helpers.waits import ENGINE_START_SECONDS, FLEET_TEST_TIMEOUT, until
from trainer_client import FleetAdminClient

MODEL = "skyrl-tiny-llama"


def completion(base: str, session: str) -> int:
    """A short completion through SMG in ``session``: its HTTP status."""
    body = {"model": MODEL, "prompt": f"hello from {session}", "max_tokens": 4}
    answer = httpx.post(f"{base}/completions", json=body, headers={SESSION_ID: session}, timeout=60)
    return answer.status_code


def workers(base: str) -> set[str]:
    listed = httpx.get(base.removesuffix("/v1") + "/workers", timeout=10).json()
    return {w["url"] for w in (listed.get("workers", []) if isinstance(listed, dict) else listed)}


def smg_processes(up: Up) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(up.proc.pid).children(recursive=True)
        if p.name().startswith("smg")  # smg's script names its process "smg::router"
    ]


@pytest.mark.engine
@pytest.mark.timeout(FLEET_TEST_TIMEOUT)
async def test_up_keeps_smg_in_front_of_the_fleet_as_servers_come_die_and_go(
    tmp_path: Path,
) -> None:
    flags = ["--admin-port", "0", "--gateway", "smg", "--gateway-port", "0"]
    # One of SMG's own flags through up, seen in its metrics: a request-duration bucket.
    flags += ["--gateway-args=--prometheus-duration-buckets 0.25 7.5"]
    up = Up(tmp_path / "logs", servers=1, server_flags=flags)
    try:
        await asyncio.to_thread(up.wait_for, "Ctrl-C to stop", ENGINE_START_SECONDS)
        base = up.wait_for("SMG (OpenAI API): ", 1).split(": ", 1)[1]
        first = up.wait_for("server 0: ", 1).split(": ", 1)[1]
        assert workers(base) == {worker_url(first)}
        assert await asyncio.to_thread(completion, base, "a") == 200
        gateway = smg_processes(up)
        assert len(gateway) == 1, [p.cmdline() for p in gateway]
        url = up.wait_for("SMG metrics: ", 1).split(": ", 1)[1]
        metrics = await asyncio.to_thread(httpx.get, url, timeout=10)
        assert metrics.status_code == 200 and 'le="7.5"' in metrics.text, metrics.text[-2000:]

        # A server added: SMG's workers follow, and it serves through it.
        admin = up.wait_for("fleet admin: ", 1).split(": ", 1)[1]
        with FleetAdminClient(admin) as fleet_admin:
            grown = await asyncio.to_thread(fleet_admin.scale, 2, ENGINE_START_SECONDS)
        second = grown.servers[1]
        both = {worker_url(first), worker_url(second)}
        await until(lambda: workers(base) == both, what=f"SMG to list {both}")
        statuses = [await asyncio.to_thread(completion, base, f"s{i}") for i in range(8)]
        assert statuses == [200] * 8

        # The new server killed: up restarts it on its address, SMG keeps it listed and
        # serves through the death (its health checks take the dead one out).
        port = int(second.rpartition(":")[2])
        victim = next(
            p
            for p in psutil.Process(up.proc.pid).children(recursive=True)
            if p.cmdline()[1:3] == ["-m", "servers.engine"]
            and port in {c.laddr.port for c in p.net_connections(kind="tcp")}
        )
        victim.kill()
        await asyncio.to_thread(up.wait_for, f"({second}) died", 60)

        async def serves() -> bool:
            answers = [await asyncio.to_thread(completion, base, f"d{i}") for i in range(4)]
            return answers == [200] * 4

        await until(serves, timeout=60, what="SMG to serve again with one server dead")
        await asyncio.to_thread(up.wait_for, "is back", ENGINE_START_SECONDS)
        assert workers(base) == both
        assert await serves()

        # The server removed: SMG's workers follow.
        up.type("scale 1")
        await asyncio.to_thread(up.wait_for, "drained and removed", 120)
        await until(lambda: workers(base) == {worker_url(first)}, what="SMG to drop it")
        assert any(f"smg: removed worker {worker_url(second)}" in line for line in up.lines)
        assert await asyncio.to_thread(completion, base, "z") == 200
        assert await asyncio.to_thread(up.stop), "up ignored SIGINT (Ctrl-C)"
        assert not any(p.is_running() for p in gateway), "SMG outlived up"
    finally:
        up.stop()


def test_up_refuses_smg_in_front_of_servers_it_could_not_call() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "servers.cli", "up", "--gateway", "smg", "--data-token", "t"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "--gateway smg cannot call servers started with --data-token" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_up_refuses_gateway_flags_without_a_gateway() -> None:
    from servers import cli

    with pytest.raises(SystemExit) as refused:  # the line up exits with, before anything starts
        cli.parse(["up", "--gateway-args=--tool-call-parser qwen"])
    assert str(refused.value) == "skyrl-grpc up: --gateway-args needs --gateway smg"


def test_a_gateway_that_cannot_start_says_why_in_its_error() -> None:
    """SMG on a port already taken exits at once; the error carries its own reason (``up``
    prints it as its one line), and nothing is left running."""
    import socket

    from servers.fleet.gateway import SmgGateway

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        smg = SmgGateway("127.0.0.1", port)
        try:
            with pytest.raises(RuntimeError, match=r"smg exited .*Address already in use"):
                smg.start(["127.0.0.1:9"], timeout=60)
        finally:
            smg.close()
        assert smg._process is not None and smg._process.poll() is not None


def test_a_missing_smg_is_named_once_with_how_to_install_it() -> None:
    """``up`` prefixes the error with ``--gateway smg``; the gateway's own message names the
    executable it looked for (it once repeated the prefix)."""
    from servers.fleet.gateway import SmgGateway

    smg = SmgGateway("127.0.0.1", 1, executable=Path("/nonexistent/smg"))
    try:
        with pytest.raises(RuntimeError) as missing:
            smg.start(["127.0.0.1:9"])
    finally:
        smg.close()
    assert str(missing.value) == "/nonexistent/smg not found (pip install smg)"
