"""RayFleet on a Ray cluster of three nodes simulated on this machine (several raylets,
``ray.cluster_utils.Cluster``): 2 CPU servers + router, a client in a Ray actor, teardown; and
placement across nodes by strategy and named resources, by Ray's own view of where each actor
runs. One cluster for the module: starting Ray is the slow part."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from servers.engine.scratch import PREFIX as SCRATCH_PREFIX
from servers.fleet import FleetStartFailed
from servers.fleet.ray_group import RayFleet
from skyrl_grpc.v1.data_plane_pb2 import GenerateRequest
from skyrl_grpc.v1.data_plane_pb2_grpc import DataPlaneStub
from trainer_client import BlockingInferenceClient

pytestmark = [pytest.mark.engine]


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


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[list[str]]:
    """A head without room for servers and two worker nodes offering an "inference" resource;
    yields the workers' node ids."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    workers = [
        cluster.add_node(num_cpus=2, resources={"inference": 2}, object_store_memory=128 << 20)
        for _ in range(2)
    ]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield [w.node_id for w in workers]
    ray.shutdown()
    cluster.shutdown()


def test_ray_fleet_serves_through_its_router_and_leaves_no_processes(
    ray_cluster: list[str],
) -> None:
    import ray

    # Server flags reach the servers on Ray as they do local processes.
    group = RayFleet(2, cpu_only=True, server_args=["--enable-lora", "--max-n", "3"])
    addresses = group.start()
    router, servers = addresses.router, list(addresses.servers)
    actor_pids = group.pids()
    tree = process_tree(actor_pids)
    # Each server actor's temporary directory of its own (servers.engine.scratch), named by
    # its process; none for the router's.
    scratch = [
        path
        for pid in actor_pids
        for path in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}{pid}-*")
    ]
    try:
        assert len(scratch) == 2 and all(path.is_dir() for path in scratch), scratch
        assert len(servers) == 2 and router not in servers
        client = BlockingInferenceClient(router, servers)
        result = client.generate([1, 2, 3], {"temperature": 0.0, "max_tokens": 6})
        assert len(result.token_ids) == 6
        assert client.world_size() == 2
        assert all(i.capabilities.lora.enabled for i in client.server_info().values())
        with grpc.insecure_channel(servers[0]) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                DataPlaneStub(channel).Generate(GenerateRequest(prompt_token_ids=[1, 2], n=4))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "--max-n" in refused.value.details()  # type: ignore[attr-defined]
        assert len(tree) > len(actor_pids)  # the engines run in processes of their own

        @ray.remote(num_cpus=0)
        class Rollouts:
            def run(self, client: BlockingInferenceClient) -> tuple[list[int], bool, bool]:
                tokens = client.generate([1, 2, 3], {"temperature": 0.0, "max_tokens": 6}).token_ids
                client.pause("keep")
                paused = client.all_paused()
                client.resume()
                return tokens, paused, client.all_paused()

        tokens, paused, still_paused = ray.get(Rollouts.remote().run.remote(client), timeout=120)
        assert tokens == result.token_ids and paused and not still_paused
    finally:
        group.close()
    deadline = time.monotonic() + 30
    while alive := [
        p
        for p in tree
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]:
        assert time.monotonic() < deadline, f"processes left behind: {alive}"
        time.sleep(0.5)
    while left := [path for path in scratch if path.exists()]:  # removed by their reapers
        assert time.monotonic() < deadline, f"scratch directories left behind: {left}"
        time.sleep(0.5)


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
    deadline = time.monotonic() + 60  # Ray returns a removed group's bundles asynchronously
    while (free := ray.available_resources()).get("CPU") != total.get("CPU"):
        assert time.monotonic() < deadline, f"resources still held: {free} of {total}"
        time.sleep(0.2)


def test_an_unknown_strategy_or_flag_is_refused_before_ray_is_touched() -> None:
    with pytest.raises(ValueError, match="STRICT_SPREAD"):
        RayFleet(2, strategy="EVERYWHERE")
    with pytest.raises(ValueError, match="--no-such-flag"):  # the serve command's parser
        RayFleet(2, server_args=["--no-such-flag"])
