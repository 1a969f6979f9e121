"""RayFleet on a local Ray cluster: 2 CPU servers + router, a client in a Ray actor, teardown."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import psutil
import pytest

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
def ray_cluster() -> Iterator[None]:
    import ray

    ray.init(
        num_cpus=4, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False
    )
    yield
    ray.shutdown()


def test_ray_fleet_serves_through_its_router_and_leaves_no_processes(ray_cluster: None) -> None:
    import ray

    # Server flags reach the servers on Ray as they do local processes.
    group = RayFleet(2, cpu_only=True, server_args=["--enable-lora", "--max-n", "3"])
    addresses = group.start()
    router, servers = addresses.router, list(addresses.servers)
    actor_pids = group.pids()
    tree = process_tree(actor_pids)
    try:
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
