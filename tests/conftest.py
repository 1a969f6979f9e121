"""Shared fixtures: the tiny model, one in-process engine server per test session, channels."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from skyrl_grpc.tiny_model import ensure_tiny_model
from tests.helpers.waits import ENGINE_START_SECONDS

ROOT = Path(__file__).resolve().parents[1]
# Ray clusters the tests start run engine servers at the niceness every other test process
# has (Ray's own default, 15, starves them whenever anything else keeps the cores busy).
os.environ.setdefault("RAY_worker_niceness", "0")

REFERENCE_PROMPTS = [[1, 45, 722, 84], [1, 300, 301, 302, 303, 304], [1, 7, 900, 12, 1500]]
REFERENCE_MAX_TOKENS = 24


# Files that start a Ray cluster of their own (a head node and workers): one cluster at a time.
RAY_CLUSTER_FILES = ("test_ray_fleet.py", "test_ray_supervision.py")
# Files that build a testbed of hosts, each host an engine server: one at a time, or two
# testbeds' engines starve each other's starts on two cores.
TESTBED_FILES = (
    "test_multihost.py",
    "test_multihost_tls.py",
    "test_multihost_faults.py",
    "test_multihost_ray.py",
    "test_nemesis.py",
)
# Files whose fleets keep both cores busy for a minute (kill -9 under streams, a training loop
# while the fleet grows): run with the testbeds, one after the other, never beside them, whose
# faults are measured against seconds-long bounds (a stream's stall when its host is cut off
# went from under 3 s alone to 5.5-13 s beside them).
BUSY_FLEET_FILES = ("test_warm_standby.py", "test_local_scale.py")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (scripts/test.sh): a file's tests run on one worker, so its module
    fixtures (engines, reference servers) start once, and the files that start a Ray cluster run
    on the same worker, one after the other, as do the files that build a testbed of hosts. (xdist's ``loadgroup`` marks would say the second;
    they do not take on pytest 9, whose items no longer read the ``_nodeid`` xdist rewrites.)"""
    from xdist.scheduler import LoadFileScheduling

    class ByFileRayTogether(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            name = path.rpartition("/")[2]
            if name in RAY_CLUSTER_FILES:
                return "ray-clusters"
            return "testbeds" if name in TESTBED_FILES + BUSY_FLEET_FILES else path

    return ByFileRayTogether(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()


def offline_reference(
    model_dir: Path, prompts: list[list[int]], sampling: dict[str, Any], tmp_dir: Path
) -> list[dict[str, Any]]:
    """Greedy/seeded outputs of vLLM's offline LLM in a fresh process (a fresh engine start)."""
    spec = tmp_dir / f"spec-{os.getpid()}-{len(list(tmp_dir.iterdir()))}.json"
    spec.write_text(json.dumps({"model": str(model_dir), "prompts": prompts, "sampling": sampling}))
    result = subprocess.run(
        [sys.executable, "-m", "tests.helpers.offline_reference", str(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=ENGINE_START_SECONDS,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def greedy_reference(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    sampling = {
        "temperature": 0.0,
        "max_tokens": REFERENCE_MAX_TOKENS,
        "logprobs": 0,
        "ignore_eos": True,
    }
    return offline_reference(
        tiny_model_dir, REFERENCE_PROMPTS, sampling, tmp_path_factory.mktemp("reference")
    )


async def running_engine_server(**engine: Any) -> AsyncIterator[Any]:
    """A real vLLM engine server on the tiny model (``engine``: EngineOptions fields), in this
    process, drained afterwards."""
    from servers.engine.options import EngineOptions, ServerOptions
    from servers.engine.process.engine_server import EngineServer

    server = EngineServer(ServerOptions(engine=EngineOptions(**engine)))
    await server.start()
    await asyncio.wait_for(server.wait_ready(), timeout=ENGINE_START_SECONDS)
    yield server
    await server.drain(grace=1)


@pytest.fixture(scope="session")
async def engine_server(tiny_model_dir: Path) -> AsyncIterator[Any]:
    """One real vLLM engine server for the whole session (engine start costs ~20 s)."""
    async for server in running_engine_server():
        yield server


@pytest.fixture(scope="session")
async def engine_channel(engine_server: Any) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(engine_server.address) as channel:
        yield channel


@pytest.fixture(scope="session")
async def second_engine_server(engine_server: Any) -> AsyncIterator[Any]:
    """A second real engine server, for fan-out and multi-server tests; seeded apart from the
    first, as a fleet seeds its servers (``servers.fleet.seeds``)."""
    async for server in running_engine_server(seed=1):
        yield server


async def running_router(backends: list[str], **options: Any) -> AsyncIterator[Any]:
    """A router in this process in front of ``backends`` (``options``: RouterOptions fields),
    yielded once every backend is healthy."""
    from servers.router.router_server import RouterOptions, RouterServer

    router = RouterServer(RouterOptions(backends=backends, health_check_interval=0.2, **options))
    await router.start()
    await router.wait_healthy(len(backends))
    yield router
    await router.stop(0)


SHARED_ROUTERS = {"two_server_router", "http_router"}


@pytest.fixture(autouse=True)
async def _shared_servers_on_one_version(request: pytest.FixtureRequest) -> None:
    """A test on both shared engine servers starts with them on one weight version: placement
    keeps calls off a server behind the other, so what an earlier test left (a delta to one, a
    version pushed to one) must not decide where this test's calls go."""
    if "second_engine_server" not in request.fixturenames:
        return
    from safetensors.torch import load_file

    from tests.helpers.waits import until
    from tests.helpers.weights import on_one_version
    from trainer_client import InferenceClient

    servers = [
        request.getfixturevalue(f).address for f in ("engine_server", "second_engine_server")
    ]
    client = InferenceClient(servers[0], servers, direct=False)
    model = request.getfixturevalue("tiny_model_dir")
    await on_one_version(client, load_file(str(model / "model.safetensors")))
    versions = set((await client.weight_versions()).values())
    await client.close()
    # A shared router learns versions from the servers' status streams, a moment later: until
    # it does, it keeps this test's calls off the server it still sees behind.
    for name in SHARED_ROUTERS & set(request.fixturenames):
        backends = request.getfixturevalue(name).pool.backends

        def caught_up(backends: list[Any] = backends) -> bool:
            return {b.weight_version for b in backends} == versions and all(
                b.eligible and not b.paused for b in backends
            )

        await until(
            caught_up,
            what=f"{name} to see both servers healthy, running, on versions {versions}",
        )


@pytest.fixture(scope="session")
async def two_server_router(engine_server: Any, second_engine_server: Any) -> AsyncIterator[Any]:
    """A router in front of both real engine servers."""
    async for router in running_router([engine_server.address, second_engine_server.address]):
        yield router


@pytest.fixture(scope="session")
async def one_server_router(engine_server: Any) -> AsyncIterator[Any]:
    """A router in front of the session's engine server."""
    async for router in running_router([engine_server.address]):
        yield router


@pytest.fixture(scope="session")
async def http_router(engine_server: Any, second_engine_server: Any) -> AsyncIterator[Any]:
    """A router with its OpenAI HTTP edge in front of both real engine servers."""
    backends = [engine_server.address, second_engine_server.address]
    async for router in running_router(backends, http_port=0):
        yield router
