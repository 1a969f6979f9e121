"""The engine server as a real process: health through start and drain, SIGTERM, grpcurl."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.helpers.server_process import ServerProcess, alive
from tests.helpers.waits import wait_until

pytestmark = [pytest.mark.engine]
GRPCURL = str(Path(sys.executable).with_name("grpcurl"))
DATA_PLANE = "skyrl.inference.v1.DataPlane"
CONTROL_PLANE = "skyrl.inference.v1.ControlPlane"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class WhileStarting:
    """What a server answered between opening its port and its engine being ready."""

    liveness: int
    data_plane: int
    model_info_error: grpc.RpcError


def health_status(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status  # type: ignore[no-any-return]


def probe_while_starting(server: ServerProcess) -> WhileStarting:
    """Health and a data-plane call, asked at once after the "listening" line: the engine
    takes seconds to start after it, even on an idle machine."""
    address = server.until("listening")["address"]
    liveness, data_plane = health_status(address, ""), health_status(address, DATA_PLANE)
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as raised:
        data_plane_pb2_grpc.DataPlaneStub(channel).GetModelInfo(
            data_plane_pb2.GetModelInfoRequest(), timeout=30
        )
    return WhileStarting(liveness, data_plane, raised.value)


@pytest.fixture(scope="module")
def server_process() -> Iterator[tuple[ServerProcess, WhileStarting]]:
    """A ready server process, and what it answered while it was starting."""
    server = ServerProcess("--drain-grace-seconds", "20")
    try:
        starting = probe_while_starting(server)
        server.until("ready")
        yield server, starting
    finally:
        server.kill()


def test_health_not_serving_while_starting_then_serving(
    server_process: tuple[ServerProcess, WhileStarting],
) -> None:
    server, starting = server_process
    # The port opens before vLLM starts (which takes seconds): liveness up, services not ready.
    assert starting.liveness == SERVING
    assert starting.data_plane == NOT_SERVING
    assert starting.model_info_error.code() == grpc.StatusCode.UNAVAILABLE
    assert "starting" in (starting.model_info_error.details() or "")
    # Then ready (the fixture waited for the "ready" line): both services serve.
    assert health_status(server.address, DATA_PLANE) == SERVING
    assert health_status(server.address, CONTROL_PLANE) == SERVING


def grpcurl(*args: str) -> str:
    result = subprocess.run(
        [GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_grpcurl_lists_describes_and_calls(
    server_process: tuple[ServerProcess, WhileStarting],
) -> None:
    address = server_process[0].address
    services = grpcurl(address, "list").split()
    assert (
        DATA_PLANE in services and CONTROL_PLANE in services and "grpc.health.v1.Health" in services
    )
    described = grpcurl(address, "describe", "skyrl.inference.v1.SamplingParams")
    assert "optional float temperature = 1;" in described
    generated = json.loads(
        grpcurl(
            "-d",
            '{"prompt_token_ids": [1, 45, 722],'
            ' "sampling_params": {"temperature": 0, "max_tokens": 5}}',
            address,
            f"{DATA_PLANE}/Generate",
        )
    )
    assert len(generated["samples"][0]["tokenIds"]) == 5
    assert generated["samples"][0]["finishReason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
    grpcurl("-d", '{"mode": "PAUSE_MODE_KEEP"}', address, f"{CONTROL_PLANE}/Pause")
    assert json.loads(grpcurl(address, f"{CONTROL_PLANE}/IsPaused")) == {"paused": True}
    grpcurl(address, f"{CONTROL_PLANE}/Resume")
    assert json.loads(grpcurl(address, f"{CONTROL_PLANE}/IsPaused")) == {}


@pytest.fixture
def server_to_stop() -> Iterator[ServerProcess]:
    """A ready server process of the test's own: the test ends it."""
    server = ServerProcess("--drain-grace-seconds", "60")
    try:
        server.until("ready")
        yield server
    finally:
        server.kill()


def test_sigterm_drains_in_flight_streams_then_exits(server_to_stop: ServerProcess) -> None:
    server_process = server_to_stop

    async def scenario() -> tuple[list[int], list[int], int]:
        async with grpc.aio.insecure_channel(server_process.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=DATA_PLANE))
            statuses: list[int] = [(await watch.read()).status]
            stream = data_plane_pb2_grpc.DataPlaneStub(channel).GenerateStream(
                data_plane_pb2.GenerateStreamRequest(
                    prompt_token_ids=[1, 2, 3],
                    sampling_params=gen.SamplingParams(
                        temperature=0, max_tokens=300, ignore_eos=True
                    ),
                )
            )
            tokens: list[int] = []
            finish = 0
            async for chunk in stream:
                if not tokens:
                    server_process.proc.send_signal(signal.SIGTERM)
                    statuses.append((await watch.read()).status)
                tokens.extend(chunk.token_ids)
                finish = chunk.finish_reason
            return statuses, tokens, finish

    statuses, tokens, finish = asyncio.run(scenario())
    assert statuses == [SERVING, NOT_SERVING]  # routers learn first...
    assert len(tokens) == 300 and finish == gen.FINISH_REASON_LENGTH  # ...then the stream completes
    assert server_process.proc.wait(timeout=120) == 0  # drained, then exited on its own


def test_sigterm_while_the_engine_starts_stops_the_server_at_once(tmp_path: Path) -> None:
    """Stopped before its engine is ready (here while vLLM's modules import, the seconds after
    its port opens), a server ends its start: it says "stopped" and exits 0 without waiting for
    the import to finish, and never says "ready". (It used to raise out of its event loop,
    exit 1 without "stopped", and only once the import had finished.)"""
    logs = tmp_path / "server.log"
    server = ServerProcess(stderr=logs)
    try:
        server.until("listening")
        server.proc.send_signal(signal.SIGTERM)
        server.until("stopped")
        assert server.proc.wait(timeout=120) == 0
        assert "ready" not in [event["event"] for _, event in server.events]
        # The import thread did not get to its end: the process did not wait for it.
        assert "modules imported" not in logs.read_text()
    finally:
        server.kill()


def test_sigkill_of_skyrl_grpc_serve_leaves_no_process_of_its_tree() -> None:
    # The command the README teaches, killed as the kernel's OOM killer would: vLLM's engine
    # processes must not outlive it (they hold the model's memory).
    import psutil

    launcher = str(Path(sys.executable).with_name("skyrl-grpc"))
    server = ServerProcess(command=(launcher, "serve"))
    try:
        server.until("ready")
        tree = psutil.Process(server.proc.pid).children(recursive=True)
        assert tree, "the server started no process of its own (engine core, watchdog)"
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        wait_until(lambda: not alive(tree), 15, f"the server's processes gone: {tree}")
    finally:
        server.kill()


def test_a_pause_and_a_weight_update_wait_for_a_server_still_starting_and_include_it(
    tiny_model_dir: Path,
) -> None:
    """A server up but not serving yet (restarted or added: warming up, catching up with its
    peers): a pause or an update told not to wait fails on it (UNAVAILABLE, "starting"); by
    default they wait for it, so a training step (pause, update, resume) includes it."""
    from safetensors.torch import load_file

    from tests.helpers.weights import perturbed
    from trainer_client import FanOutError, InferenceClient, WeightUpdateError

    weights = perturbed(load_file(str(tiny_model_dir / "model.safetensors")), seed=1)
    server = ServerProcess()
    try:
        address = server.until("listening")["address"]

        async def scenario() -> None:
            client = InferenceClient(address, [address])
            with pytest.raises(FanOutError) as refused_pause:
                await client.pause(wait_for_starting=0)
            assert "starting" in str(refused_pause.value)
            with pytest.raises(WeightUpdateError) as refused:
                await client.update_weights(weights.items(), 1, wait_for_starting=0)
            assert "starting" in str(refused.value)
            assert await client.pause() == [address]
            assert await client.all_paused()
            commits = await client.update_weights(weights.items(), 1)
            assert commits[address].weight_version == 1
            assert await client.resume() == [address]
            assert (await client.weight_versions())[address] == 1
            assert not await client.all_paused()
            await client.close()

        asyncio.run(scenario())
        assert health_status(address, CONTROL_PLANE) == SERVING
    finally:
        server.kill()


def test_routed_experts_asked_of_an_engine_that_cannot_capture_them_are_refused_at_start() -> None:
    """``--enable-return-routed-experts`` goes to vLLM, whose CPU build cannot capture routed
    experts: the server says it failed with vLLM's reason and exits 1 (it never serves
    requests that would silently come back without them)."""
    server = ServerProcess("--enable-return-routed-experts")
    try:
        failed = server.until("failed")
        assert "Model Runner V2" in failed["error"], failed  # vLLM's own words
        assert server.proc.wait(timeout=120) == 1
        assert "ready" not in [event["event"] for _, event in server.events]
    finally:
        server.kill()
