"""RayFleet across Ray nodes (several raylets on this machine, ``ray.cluster_utils.Cluster``):
servers land where the placement strategy and the named resources say, by Ray's own view of
where each actor runs, and serve through the router."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from servers.fleet.ray_group import RayFleet
from trainer_client import BlockingInferenceClient

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def three_nodes() -> Iterator[Any]:
    """A head without room for servers and two worker nodes offering an "inference" resource."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
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


def test_strict_spread_puts_one_server_on_each_named_node(three_nodes: list[str]) -> None:
    fleet = RayFleet(2, cpu_only=True, strategy="STRICT_SPREAD", resources={"inference": 1})
    fleet.start()
    try:
        nodes = fleet.node_ids()
        assert len(set(nodes)) == 2 and set(nodes) == set(three_nodes)  # not on the head
        client = BlockingInferenceClient(fleet.addresses.router, list(fleet.addresses.servers))
        for session in ("a", "b", "c"):
            result = client.generate([1, 2, 3], {"max_tokens": 4}, session_id=session)
            assert len(result.token_ids) == 4
        client.close()
    finally:
        fleet.close()


def test_an_unknown_strategy_or_flag_is_refused_before_ray_is_touched() -> None:
    with pytest.raises(ValueError, match="STRICT_SPREAD"):
        RayFleet(2, strategy="EVERYWHERE")
    with pytest.raises(ValueError, match="--no-such-flag"):  # the serve command's parser
        RayFleet(2, server_args=["--no-such-flag"])
