"""A local Ray cluster for the tests that place the stack on Ray, started again once where
Ray's own start gives up: a node's raylet must register within 30 s (fixed in Ray's
``node.py``), which a head started while the other worker's engines load the two cores can
miss ("The current node timed out during startup")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

RAY_START_ATTEMPTS = 2


def started_cluster() -> Any:
    """``ray.cluster_utils.Cluster`` with a head of one CPU and no dashboard."""
    from ray.cluster_utils import Cluster

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            return Cluster(
                initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
            )
        except Exception as error:
            if "timed out during startup" not in str(error) or attempt == RAY_START_ATTEMPTS:
                raise
            # What the failed start left (its GCS, its raylet) stopped: the Ray tests run one
            # cluster at a time (tests/conftest.py), so every Ray process here is its.
            ray = str(Path(sys.executable).with_name("ray"))
            subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=60, check=False)
    raise AssertionError("unreachable")
