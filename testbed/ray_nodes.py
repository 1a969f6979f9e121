"""A Ray cluster across testbed hosts, started as an operator starts one on machines of their
own: ``ray start --head`` inside one host's namespace, then ``ray start --address`` inside each
of the others, every node with its own host's address (``--node-ip-address``), so the cluster's
traffic (its control plane, its actors' calls) crosses the hosts' links and their faults.

Ray's health checks are tightened (``HEALTH_ENV``): a node that stops answering is dead to the
cluster in ~5 s instead of ~30 s; a link down for 2 s stays well inside that. A node joins at a
time and is started again if it does not register (Ray gives a raylet 30 s, which several
starting at once on two cores can miss). Every node's files are in a directory of the cluster's
own (``--temp-dir``), never in ``/tmp/ray`` beside another cluster's on the same machine.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from subprocess import Popen

from testbed import CommandFailed, Host

RAY_PORT = 6379
ROOT = Path(__file__).resolve().parents[1]
# Ray's node health checks: a ping every second, dead after five missed.
HEALTH_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_failure_threshold": "5",
    "RAY_USAGE_STATS_ENABLED": "0",
    # No token authentication, whatever ~/.ray holds: a token there (any local ``ray.init()``
    # writes one) turned it on for the head, whose nodes then never registered.
    "RAY_AUTH_MODE": "disabled",
    "PYTHONPATH": str(ROOT),
    # Engine servers at the niceness every other process has (Ray's default, 15, starves them
    # whenever anything else keeps the cores busy).
    "RAY_worker_niceness": "0",
}
# A node's object store: Ray's smallest (the stack moves nothing through it).
OBJECT_STORE_BYTES = 100_000_000
JOIN_ATTEMPTS = 3
JOIN_SECONDS = 90.0


def ray_command(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


class RayCluster:
    """A head on ``head``, workers joined with ``join``; its processes are the hosts' (the
    testbed's ``close`` and ``Host.kill`` end them)."""

    def __init__(self, head: Host, temp_dir: Path, log_dir: Path | None = None) -> None:
        self.head = head
        self.temp_dir = temp_dir
        self.log_dir = log_dir
        self.nodes: dict[str, Popen[str]] = {}

    @property
    def address(self) -> str:
        return f"{self.head.address}:{RAY_PORT}"

    def _start(self, host: Host, extra: list[str], cpus: int) -> Popen[str]:
        command = [
            ray_command("ray"), "start", "--block", "--disable-usage-stats",
            "--node-ip-address", host.address, "--num-cpus", str(cpus),
            "--object-store-memory", str(OBJECT_STORE_BYTES), *extra,
        ]  # fmt: skip
        log = None if self.log_dir is None else open(self.log_dir / f"ray-{host.name}.log", "a")
        process = host.popen(command, env=HEALTH_ENV, log=log)
        self.nodes[host.name] = process
        return process

    def start(self, cpus: int = 1) -> None:
        """The head (its GCS and a raylet with ``cpus``; no dashboard)."""
        head = ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"]
        process = self._start(self.head, [*head, "--temp-dir", str(self.temp_dir)], cpus)
        self._until_alive(1, process, self.head)

    def join(self, host: Host, cpus: int = 1, resources: Mapping[str, float] | None = None) -> None:
        """``host`` joins as a worker node, with ``cpus`` and custom ``resources``."""
        expected = self.alive() + 1
        extra = ["--address", self.address]
        if resources:
            extra += ["--resources", json.dumps(dict(resources))]
        for attempt in range(1, JOIN_ATTEMPTS + 1):
            process = self._start(host, extra, cpus)
            try:
                self._until_alive(expected, process, host)
                return
            except CommandFailed:
                host.kill()
                if attempt == JOIN_ATTEMPTS:
                    raise

    def _until_alive(self, count: int, process: Popen[str], host: Host) -> None:
        deadline = time.monotonic() + JOIN_SECONDS
        while self.alive() < count:
            if process.poll() is not None or time.monotonic() > deadline:
                raise CommandFailed(f"the Ray node on {host.name} did not register")
            time.sleep(0.5)

    def alive(self) -> int:
        """Nodes the cluster counts alive, as a driver on the head host reads them (-1: no
        answer yet)."""
        code = (
            f"import ray;ray.init(address={self.address!r}, log_to_driver=False);"
            "print('ALIVE', sum(n['Alive'] for n in ray.nodes()))"
        )
        done = self.head.run([sys.executable, "-c", code], timeout=120, env=HEALTH_ENV)
        for line in done.stdout.splitlines():
            if line.startswith("ALIVE "):
                return int(line.split()[1])
        return -1
