"""A local Ray cluster for the tests that place the stack on Ray, started again once where
Ray's own start gives up: a node's raylet must register within 30 s (fixed in Ray's
``node.py``), which a head started while the other worker's engines load the two cores can
miss ("The current node timed out during startup")."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

# Three: in one full run both of two attempts missed it, beside the Ray-on-testbed tests.
RAY_START_ATTEMPTS = 3
# The processes a Ray node runs (what ``ray stop`` looks for).
RAY_PROCESSES = ("gcs_server", "raylet", "ray::", "default_worker.py", "dashboard", "ray/_private")


def stop_ray_processes_here() -> None:
    """``ray stop --force`` for this network namespace only: Ray's own stops every Ray process
    on the machine, a testbed's namespaced cluster's too."""
    here = os.readlink("/proc/self/ns/net")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(entry / "ns" / "net") != here:
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if any(name in command for name in RAY_PROCESSES):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


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
            # cluster at a time (tests/conftest.py), so every Ray process in this network
            # namespace is its (a testbed's Ray nodes, in namespaces of their own, are not).
            stop_ray_processes_here()
    raise AssertionError("unreachable")
