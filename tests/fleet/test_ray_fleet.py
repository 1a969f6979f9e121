"""RayFleet on a Ray cluster of three nodes simulated on this machine (several raylets,
``ray.cluster_utils.Cluster``): 2 CPU servers + router, a client in a Ray actor, teardown; and
placement across nodes by strategy and named resources, by Ray's own view of where each actor
runs. One cluster for the module: starting Ray is the slow part."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from servers.engine.process.scratch import PREFIX as SCRATCH_PREFIX
from servers.fleet import FleetStartFailed, gateway
from servers.fleet.ray_group import RayFleet
from skyrl_grpc.v1.data_plane_pb2 import GenerateRequest
from skyrl_grpc.v1.data_plane_pb2_grpc import DataPlaneStub
from tests.helpers.ray_cluster import started_cluster
from tests.helpers.waits import wait_until
from trainer_client import BlockingInferenceClient

pytestmark = [pytest.mark.engine]
ROOT = Path(__file__).resolve().parents[2]


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def process_tree(pids: list[int]) -> set[int]:
    """The given processes and all their descendants (the engines they started)."""
    found = set()
    for pid in pids:
        try:
            process = psutil.Process(pid)
            found |= {pid, *(child.pid for child in process.children(recursive=True))}
        except psutil.NoSuchProcess:
            pass
    return found


CLUSTER_ADDRESS: list[str] = []  # the module cluster's, for commands that join it


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[list[str]]:
    """A head without room for servers and two worker nodes offering an "inference" resource;
    yields the workers' node ids."""
    import ray

    cluster = started_cluster()
    workers = [
        cluster.add_node(num_cpus=2, resources={"inference": 2}, object_store_memory=128 << 20)
        for _ in range(2)
    ]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    CLUSTER_ADDRESS[:] = [cluster.address]
    yield [w.node_id for w in workers]
    ray.shutdown()
    cluster.shutdown()


def test_ray_fleet_serves_through_its_router_and_leaves_no_processes(
    ray_cluster: list[str], tmp_path: Path
) -> None:
    import httpx
    import ray

    from skyrl_grpc.process_group import free_port

    # Server flags reach the servers on Ray as they do local processes, and so do the stack's
    # own: the servers' ports, the router's OpenAI edge and metrics (two router replicas on its
    # ports), a log file per actor. No cpu_only: the installed engine is vLLM's CPU build, so
    # its bundles ask for no GPU.
    ports = [free_port("127.0.0.1") for _ in range(2)]
    group = RayFleet(
        2,
        server_args=["--enable-lora", "--max-n", "3"],
        server_ports=ports,
        http_port=0,
        metrics_port=0,
        log_dir=str(tmp_path / "logs"),
        router_replicas=2,
    )
    assert group.bundle() == {"CPU": 1.0}
    # Directories already there are not this fleet's: a process ID is reused once the IDs wrap
    # (CI's pid_max is 32768), and an earlier engine's directory can bear an actor's ID.
    earlier = set(Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"))
    addresses = group.start()
    router, servers = addresses.router, list(addresses.servers)
    assert [int(s.rpartition(":")[2]) for s in servers] == ports
    assert group.http_port and group.metrics_port
    models = httpx.get(f"http://127.0.0.1:{group.http_port}/v1/models", timeout=30).json()
    assert models["data"][0]["id"]
    assert "skyrl_router" in httpx.get(f"http://127.0.0.1:{group.metrics_port}/metrics").text
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["router.log", "server-0.log", "server-1.log"], logs
    assert "Initializing a V1 LLM engine" in (tmp_path / "logs" / "server-0.log").read_text()
    actor_pids = group.pids()
    tree = process_tree(actor_pids)
    # Each server actor's temporary directory of its own (servers.engine.process.scratch), named by
    # its process; none for the router's.
    scratch = [
        path
        for pid in actor_pids
        for path in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}{pid}-*")
        if path not in earlier
    ]
    try:
        assert len(scratch) == 2 and all(path.is_dir() for path in scratch), scratch
        assert len(servers) == 2 and router not in servers
        # Each actor's server seeded apart (``servers.fleet.seeds``): the same batch, sampled
        # on each alone before anything else ran there, comes back different.
        sampling = {"temperature": 1.0, "max_tokens": 12}
        sampled = []
        for server in servers:
            with BlockingInferenceClient(server, [server]) as alone:
                batch = alone.generate_batch([[1, 5, 9]] * 4, sampling)
            sampled.append([r.token_ids for r in batch])
        assert sampled[0] != sampled[1], sampled
        client = BlockingInferenceClient(router, servers)
        result = client.generate([1, 2, 3], {"temperature": 0.0, "max_tokens": 6})
        assert len(result.token_ids) == 6
        assert client.world_size() == 2
        assert all(i.capabilities.lora.enabled for i in client.server_info().values())
        with grpc.insecure_channel(servers[0]) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                DataPlaneStub(channel).Generate(GenerateRequest(prompt_token_ids=[1, 2], n=4))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-n" in (refused.value.details() or "")
        assert len(tree) > len(actor_pids)  # the engines run in processes of their own
        replicas = [
            pid for pid in tree if "--replica-id" in " ".join(psutil.Process(pid).cmdline())
        ]
        assert len(replicas) == 2, tree

        @ray.remote(num_cpus=0)
        class Rollouts:
            def run(self, client: BlockingInferenceClient) -> tuple[list[int], bool, bool]:
                tokens = client.generate([1, 2, 3], {"temperature": 0.0, "max_tokens": 6}).token_ids
                client.pause("keep")
                paused = client.all_paused()
                client.resume()
                return tokens, paused, client.all_paused()

        actor: Any = Rollouts
        tokens, paused, still_paused = ray.get(actor.remote().run.remote(client), timeout=120)
        assert tokens == result.token_ids and paused and not still_paused
        # ``up --gateway smg`` on Ray: SMG in front of the actors' servers, as locally.
        smg = gateway.launch_for(group, "127.0.0.1", 0, None)
        try:
            body = {"model": models["data"][0]["id"], "prompt": "hello", "max_tokens": 4}
            answer = httpx.post(f"{smg.base}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert set(smg.workers()) == {gateway.worker_url(s) for s in servers}
        finally:
            smg.close()
    finally:
        group.close()
    wait_until(lambda: not any(map(running, tree)), 30, f"the fleet's processes gone: {tree}")
    # Removed by their reapers.
    wait_until(lambda: not any(p.exists() for p in scratch), 30, f"{scratch} removed")


def test_strict_spread_puts_one_server_on_each_named_node(ray_cluster: list[str]) -> None:
    fleet = RayFleet(2, cpu_only=True, strategy="STRICT_SPREAD", resources={"inference": 1})
    fleet.start()
    try:
        nodes = fleet.node_ids()
        assert len(set(nodes)) == 2 and set(nodes) == set(ray_cluster)  # not on the head
        client = BlockingInferenceClient(fleet.addresses.router, list(fleet.addresses.servers))
        for session in ("a", "b", "c"):
            result = client.generate([1, 2, 3], {"max_tokens": 4}, session_id=session)
            assert len(result.token_ids) == 4
        client.close()
    finally:
        fleet.close()


def test_a_start_that_fails_or_cannot_finish_in_time_is_one_line_and_frees_the_cluster(
    ray_cluster: list[str],
) -> None:
    """What `up --ray` prints (servers.cli turns FleetStartFailed into one line): the bundles
    Ray cannot place, a server still loading at --start-timeout, or one whose start failed;
    nothing left holding the cluster's resources in any case."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    total = ray.cluster_resources()
    unplaceable = RayFleet(1, cpu_only=True, resources={"no-such-node": 1}, start_timeout=2)
    with pytest.raises(FleetStartFailed, match=r"could not place 1 server bundles.*ray status"):
        unplaceable.start()
    placed = placement_group([{"CPU": 1}])  # placed first: the bound below is the server's
    assert placed.wait(timeout_seconds=120)
    loading = RayFleet(1, cpu_only=True, placement_group=placed, start_timeout=0.5)
    with pytest.raises(FleetStartFailed, match=r"server-0 was still starting.*--start-timeout"):
        loading.start()
    remove_placement_group(placed)
    # A server whose start fails (no model where it looks) is named with the cause.
    broken = RayFleet(1, cpu_only=True, server_args=["--model", "/nonexistent/model"])
    with pytest.raises(FleetStartFailed, match=r"server-0 did not start: .*/nonexistent/model"):
        broken.start()
    # Ray returns a removed group's bundles asynchronously.
    wait_until(
        lambda: ray.available_resources().get("CPU") == total.get("CPU"),
        what=f"every CPU of {total} free again",
    )


def test_an_unknown_strategy_or_flag_is_refused_before_ray_is_touched() -> None:
    with pytest.raises(ValueError, match="STRICT_SPREAD"):
        RayFleet(2, strategy="EVERYWHERE")
    with pytest.raises(ValueError, match="--no-such-flag"):  # the serve command's parser
        RayFleet(2, server_args=["--no-such-flag"])


def test_a_gpu_engine_on_a_cluster_without_gpus_fails_at_once_naming_cpu_only(
    ray_cluster: list[str],
) -> None:
    """Not after the start timeout, waiting for bundles Ray can never place."""
    started = time.monotonic()
    with pytest.raises(FleetStartFailed, match=r"0 GPUs.*--cpu-only"):
        RayFleet(1, cpu_only=False, start_timeout=600).start()
    assert time.monotonic() - started < 60


def test_up_on_ray_stops_on_sigterm_while_ray_cannot_place_it(ray_cluster: list[str]) -> None:
    """SIGTERM during the placement wait: one line and a clean exit, not Ray's native stack
    dump; the placement group it asked for is gone with it."""
    import ray

    total = ray.cluster_resources()
    command = ["up", "--servers", "1", "--ray", "--ray-address", CLUSTER_ADDRESS[0],
               "--ray-resources", '{"nowhere": 1}', "--router-port", "0", "--base-port", "0"]  # fmt: skip
    up = subprocess.Popen(
        [sys.executable, "-m", "servers.cli", *command],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Its placement group exists: it is waiting for Ray to place it (or it exited: failed).
        wait_until(
            lambda: (
                up.poll() is not None
                or any(g["state"] == "PENDING" for g in ray.util.placement_group_table().values())
            ),
            120,
            "up's placement group, pending",
        )
        assert up.poll() is None, up.communicate()
        up.send_signal(signal.SIGTERM)
        _, stderr = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM while starting" in stderr
    assert "SIGTERM received" not in stderr and "Traceback" not in stderr, stderr
    wait_until(
        lambda: all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values()),
        what="every placement group removed",
    )
    assert ray.cluster_resources() == total
