"""Process lifecycle you can trust, against real engine-server processes: a dead engine is
never SERVING and the server exits; a model that cannot run fails at start; no orphaned engine
processes; prompt drain; the port opens before the engine loads; ``up`` supervises."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from skyrl_grpc.names import DATA_PLANE
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from tests.helpers.server_process import (
    ENV,
    ROOT,
    ServerProcess,
    alive,
)
from tests.helpers.up_process import Up
from tests.helpers.waits import (
    ENGINE_START_SECONDS,
    FLEET_TEST_TIMEOUT,
    running_on_engines,
    until,
    wait_until,
)
from trainer_client import FleetAdminClient, InferenceClient

pytestmark = [pytest.mark.engine]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(stderr=tmp_path / "server.log")
    yield process
    process.kill()


def health(address: str, service: str = DATA_PLANE) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=30).status  # type: ignore[no-any-return]


def test_a_lifecycle_line_to_a_launcher_that_is_gone_does_not_fail_the_server() -> None:
    # A server whose launcher was killed still stops cleanly: "stopped" once ended it with a
    # BrokenPipeError traceback, "the server ended abnormally" and exit code 1.
    code = (
        "import sys; from servers.common.process import announce; announce('listening'); "
        "sys.stdin.read(); announce('stopped'); announce('stopped'); print('done', file=sys.stderr)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
    assert json.loads(proc.stdout.readline())["event"] == "listening"
    proc.stdout.close()  # the launcher is gone: nothing reads the server's stdout
    proc.stdin.close()
    errors = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, errors
    assert errors.strip() == "done", errors


def test_the_port_opens_before_the_engine_loads(server: ServerProcess) -> None:
    listening = server.until("listening")
    opened = server.events[-1][0]
    # The engine (vLLM imports, model load, warm-up) takes seconds; the port is open well before.
    assert health(listening["address"], "") == SERVING
    assert health(listening["address"]) == NOT_SERVING
    server.until("ready")
    assert server.events[-1][0] - opened > 3 * opened, server.events
    assert health(listening["address"]) == SERVING


def test_a_server_reloads_at_start_and_allocates_staging_beside_its_first_generation(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """--weight-staging first-generation (the default): every layer is reloaded once from the
    serving weights before the server says it is ready (so the first update's commit does not
    pay what vLLM's first reload pays once), but the staging memory a full update writes into
    is allocated only beside the first generation, once. The weights are unchanged: the
    greedy answer before and after is the same."""
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as weights:
        parameters = len(list(weights.keys()))
    server.until("ready")
    log = tmp_path / "server.log"
    assert f"weights reloaded once at start: {parameters} parameters" in log.read_text()
    assert "prepared for weight updates" not in log.read_text()

    async def greedy() -> list[int]:
        client = InferenceClient(server.address, [server.address], direct=False)
        try:
            sampling = {"max_tokens": 8, "temperature": 0.0}
            return (await client.generate([1, 2, 3], sampling)).token_ids
        finally:
            await client.close()

    first = asyncio.run(greedy())
    wait_until(lambda: "prepared for weight updates" in log.read_text(), 120)
    assert asyncio.run(greedy()) == first
    assert log.read_text().count("prepared for weight updates") == 1


def test_a_server_started_with_staging_at_start_prepares_before_it_serves(
    tmp_path: Path,
) -> None:
    log = tmp_path / "server.log"
    process = ServerProcess("--weight-staging", "start", stderr=log)
    try:
        process.until("ready")
        assert "weights reloaded once at start" in log.read_text()
        assert "prepared for weight updates" in log.read_text()
    finally:
        process.kill()


def test_a_model_the_engine_cannot_run_fails_at_start(tmp_path: Path) -> None:
    """A checkpoint vLLM loads but cannot generate with on CPU (head_dim 16: its CPU attention
    kernels take 32 and up): the server must not report SERVING, must exit non-zero and say
    why in its last log line."""
    model = tmp_path / "model"
    built = subprocess.run(
        [sys.executable, "-m", "tests.helpers.unrunnable_model", str(model)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    log = tmp_path / "server.log"
    process = ServerProcess("--model", str(model), stderr=log)
    try:
        failed = process.until("failed")
        assert process.proc.wait(timeout=60) == 1
    finally:
        process.kill()
    assert "ready" not in [event["event"] for _, event in process.events]
    assert "head_dim=16" in failed["error"]
    last = log.read_text().strip().splitlines()[-1]
    assert "cannot generate with this model" in last and "head_dim=16" in last, last
    assert "--dtype float32" in last


def test_up_gives_up_on_a_server_still_starting_at_its_start_timeout(tmp_path: Path) -> None:
    """``up --start-timeout``: a server still loading when the bound runs out is named in one
    line (no traceback) with the flag that raises it, and up stops what it started."""
    marker = f"start-timeout-{os.getpid()}-{time.monotonic_ns()}"  # in the server's command line
    up = Up(tmp_path / "logs", servers=1, start_timeout=1, server_flags=["--data-token", marker])
    try:
        assert up.proc.wait(timeout=120) == 1
    finally:
        up.stop()
    lines = up.output(timeout=30)  # every line, read to the end (its reader may lag the exit)
    assert any("skyrl-grpc up: server-0 was still starting" in line for line in lines), lines
    assert "--start-timeout" in up.lines[-1], up.lines
    assert not any("Traceback" in line for line in up.lines), up.lines
    # Stopped and waited for before up exits (left to its own supervisor watch, a server
    # would outlive up by seconds).
    assert (tmp_path / "logs" / "server-0.log").exists()
    assert with_marker(marker) == [], "up left its server running"


def with_marker(marker: str) -> list[psutil.Process]:
    return [
        p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])
    ]


def test_a_killed_server_leaves_no_process_behind(server: ServerProcess) -> None:
    server.until("ready")
    started = server.descendants()
    assert any("EngineCore" in p.name() for p in started), [p.name() for p in started]
    # On CPU the engine core forks from a forkserver that imported vLLM beside the server
    # (servers/engine/vllm_adapter/core_preload.py): it too must go.
    core = next(p for p in started if "EngineCore" in p.name())
    forkserver = core.parent()
    assert forkserver is not None and forkserver.pid != server.proc.pid
    assert "forkserver" in " ".join(forkserver.cmdline())
    # The temporary directory the server and its engine write to (vLLM's sockets, its
    # rendezvous file, the forkserver's) is the server's own, and goes with it. (Read from the
    # forkserver: the engine core's process title overwrites its environment block.)
    scratch = Path(forkserver.environ()["TMPDIR"])
    assert scratch.name.startswith("skyrl-engine-") and scratch.is_dir()
    assert any(p.is_socket() for p in scratch.iterdir()), list(scratch.iterdir())
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    # The kernel reaps them at once; a busy box takes longer.
    wait_until(
        lambda: not alive(started) and not scratch.exists(),
        what=f"the engine's processes and {scratch} gone",
    )


def test_sigterm_of_an_idle_server_with_a_router_attached_exits_promptly(
    tmp_path: Path,
) -> None:
    # A drain grace far above the bound below, so a loaded machine cannot blur the two.
    server = ServerProcess("--drain-grace-seconds", "120", stderr=tmp_path / "server.log")
    address = server.until("ready")["address"]
    router = subprocess.Popen(
        [sys.executable, "-m", "servers.router", "--port", "0", "--backends", address],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=ENV,
    )
    try:
        assert router.stdout is not None
        router_address = json.loads(router.stdout.readline())["address"]
        with grpc.insecure_channel(router_address) as channel:  # its health watch is on
            admin = router_pb2_grpc.RouterAdminStub(channel)
            wait_until(
                lambda: (
                    admin.ListBackends(router_pb2.ListBackendsRequest()).backends[0].state
                    == router_pb2.BACKEND_STATE_HEALTHY
                ),
                what="the router to see the server healthy",
            )
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=150) == 0
        # Not held for the 120 s drain grace by the router's health watch (an idle server
        # exits ~0.6 s after SIGTERM on a quiet machine, ~2 s on a loaded one).
        assert time.monotonic() - signalled < 60.0
    finally:
        router.kill()
        router.wait()
        server.kill()


@pytest.mark.timeout(FLEET_TEST_TIMEOUT)
async def test_up_survives_an_engine_death_under_load_and_restarts_the_server(
    tmp_path: Path,
) -> None:
    up = Up(tmp_path / "logs")
    try:
        await asyncio.to_thread(up.wait_for, "Ctrl-C to stop", ENGINE_START_SECONDS)
        router = up.wait_for("router: ", 1).split(": ", 1)[1]
        servers = [up.wait_for(f"server {i}: ", 1).split(": ", 1)[1] for i in range(2)]
        victim = servers[0]
        victim_server = next(
            p
            for p in psutil.Process(up.proc.pid).children(recursive=True)
            if "servers.engine" in " ".join(p.cmdline())
            and victim.rpartition(":")[2]
            in str([c.laddr.port for c in p.net_connections(kind="tcp")])
        )
        engine_core = next(
            p for p in victim_server.children(recursive=True) if "EngineCore" in p.name()
        )
        client = InferenceClient(router, servers)
        sessions = [f"lifecycle-{i}" for i in range(32)]
        batch = asyncio.ensure_future(
            client.generate_batch(
                [[1, 200 + i, 7] for i in range(32)],
                {"temperature": 0.0, "max_tokens": 300, "ignore_eos": True},
                session_ids=sessions,
            )
        )
        await running_on_engines(client, 1, batch, servers=[victim])
        async with grpc.aio.insecure_channel(victim) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=DATA_PLANE)
            )
            assert (await watch.read()).status == SERVING
            engine_core.kill()
            # The server's health watch reports the engine's death (bound generous for a
            # loaded machine).
            seen = await asyncio.wait_for(watch.read(), 60)
            assert seen.status == NOT_SERVING
        results = await asyncio.wait_for(batch, 300)  # migrated: none of them fails
        assert [len(r.token_ids) for r in results] == [300] * 32
        died = await asyncio.to_thread(up.wait_for, f"server 0 ({victim}) died", 30)
        assert "died" in died and "the engine died" in died, died
        # New requests go to the other server meanwhile.
        fresh = await client.generate_batch(
            [[1, 300 + i] for i in range(8)], {"temperature": 0.0, "max_tokens": 8}
        )
        assert all(len(r.token_ids) == 8 for r in fresh)
        back = await asyncio.to_thread(up.wait_for, "is back", ENGINE_START_SECONDS)
        assert victim in back
        async with grpc.aio.insecure_channel(router) as channel:
            admin = router_pb2_grpc.RouterAdminStub(channel)

            async def rejoined() -> bool:
                listed = await admin.ListBackends(router_pb2.ListBackendsRequest())
                states = {b.address: b.state for b in listed.backends}
                return states[victim] == router_pb2.BACKEND_STATE_HEALTHY

            await until(rejoined, what=f"the router to see {victim} healthy again")
        versions = await client.weight_versions()
        # No peer serves newer weights (none were pushed): it serves its initial ones.
        assert versions[victim] == 0
        logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
        assert logs == ["router.log", "server-0.log", "server-1.log"]
        assert "the engine died" in (tmp_path / "logs" / "server-0.log").read_text()
        await client.close()
        assert await asyncio.to_thread(up.stop), "up ignored SIGINT (Ctrl-C)"
    finally:
        up.stop()
    assert up.proc.returncode is not None


@pytest.mark.timeout(FLEET_TEST_TIMEOUT)
async def test_up_scales_its_fleet_over_fleet_admin_and_from_its_standard_input(
    tmp_path: Path,
) -> None:
    """Grown by FleetAdmin (a trainer's FleetAdminClient, ``up --admin-port``), shrunk by
    ``scale N`` typed on up's standard input: the router follows both."""
    up = Up(tmp_path / "logs", servers=1, server_flags=["--admin-port", "0"])
    try:
        await asyncio.to_thread(up.wait_for, "Ctrl-C to stop", ENGINE_START_SECONDS)
        router = up.wait_for("router: ", 1).split(": ", 1)[1]
        admin_address = up.wait_for("fleet admin: ", 1).split(": ", 1)[1]
        up.type("grow please")
        await asyncio.to_thread(up.wait_for, "use `scale N`", 60)
        with FleetAdminClient(admin_address) as fleet_admin:
            grown = await asyncio.to_thread(fleet_admin.scale, 2, ENGINE_START_SECONDS)
        assert len(grown.servers) == 2 and grown.router == router, grown
        new = grown.servers[1]
        async with grpc.aio.insecure_channel(router) as channel:
            admin = router_pb2_grpc.RouterAdminStub(channel)
            listed = await admin.ListBackends(router_pb2.ListBackendsRequest())
            assert new in {b.address for b in listed.backends}
            up.type("scale 1")
            await asyncio.to_thread(up.wait_for, "drained and removed", 120)
            listed = await admin.ListBackends(router_pb2.ListBackendsRequest())
            assert new not in {b.address for b in listed.backends}
        assert not any("died" in line for line in up.lines), up.lines
        assert await asyncio.to_thread(up.stop), "up ignored SIGINT (Ctrl-C)"
    finally:
        up.stop()


@pytest.mark.timeout(FLEET_TEST_TIMEOUT)
def test_a_killed_up_takes_its_router_and_servers_with_it(tmp_path: Path) -> None:
    """kill -9 of ``skyrl-grpc up`` (nothing in it runs): its router, servers and gateway (SMG,
    ``--gateway smg``) end themselves, and with them their engines; none is left re-parented
    to init."""
    up = Up(tmp_path / "logs", servers=1, server_flags=["--gateway", "smg", "--gateway-port", "0"])
    try:
        up.wait_for("Ctrl-C to stop", ENGINE_START_SECONDS)
        fleet = psutil.Process(up.proc.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in fleet]
        assert any(p.name().startswith("smg") for p in fleet), [p.name() for p in fleet]
        assert any("servers.router" in c for c in commands), commands
        assert any("servers.engine" in c for c in commands), commands
        assert any("EngineCore" in p.name() for p in fleet), [p.name() for p in fleet]
        # Each in a process group of its own but all in the launcher's session: a session of
        # its own is a scheduler autogroup of its own, which a busy host starves.
        assert {os.getsid(p.pid) for p in fleet} == {os.getsid(0)}, commands
        servers = [p for p in fleet if p.cmdline()[1:3] == ["-m", "servers.engine"]]
        assert servers and all(os.getpgid(p.pid) == p.pid for p in servers), commands
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait()
        # A drain each, then their reapers: generous.
        wait_until(lambda: not alive(fleet), 120, f"up's processes gone: {fleet}")
    finally:
        up.stop()
