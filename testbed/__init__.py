"""A testbed of real (virtual) hosts on this machine, for tests and benchmarks of what crosses
a network: each host a Linux network namespace with its own address on one bridge, which sits
in a namespace of its own; each host joined to it by a veth pair whose two ends ``tc`` shapes
(the host's upload and its download); faults injected with ``nft`` and ``ip``, latency with
``testbed.delay`` (this machine's kernel has no netem).

Traffic on it cannot leave the machine: every process a test runs on it runs inside a host's
namespace (``Host.popen``), the bridge's namespace has no address at all, and no namespace has
a default route (checked when each is made). ``close()`` (the context manager's exit) kills
every process in every namespace and removes the namespaces, which removes their veths and
the bridge; namespaces that a killed run left behind are swept by the next testbed. Where it
cannot run (not root, a tool missing) ``Testbed()`` raises ``TestbedUnavailable`` in one line.

    with Testbed() as bed:
        trainer, server = bed.add_host("trainer", 800), bed.add_host("s1", 800)
        engine = server.popen([sys.executable, "-m", "servers.engine", "--host", server.address])
        bed.cut(server)      # the host's link drops every packet
        bed.heal(server)

Beside the hosts, the stand-ins the tests and benchmarks share for what this machine lacks:
``routed_experts_source``, an engine server whose vLLM hands over routed experts step by step
as a GPU runner does (vLLM's CPU build captures none).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from servers.common import reaper
from testbed.netns import (
    CommandFailed,
    TestbedUnavailable,
    check_available,
    default_routes,
    ip,
    namespaces,
    nft,
    pids_in,
    run,
    tc,
)

__all__ = ["CommandFailed", "Host", "Link", "Testbed", "TestbedUnavailable"]

PREFIX = "skt-"
# The hosts' subnet: one bridge per testbed, so testbeds side by side reuse it unseen.
SUBNET = "10.250.0"
# A host's first address octet (the next hosts count up).
FIRST_HOST = 10
_counter = itertools.count()
_ROOT = Path(__file__).resolve().parents[1]
# The packets a delayed host sends go to this queue; with no program on it, they pass.
_QUEUE = ["-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"]


@dataclass(frozen=True)
class Link:
    """A host's link to the bridge: megabits per second each way (None: unshaped)."""

    down_mbit: float | None = None
    up_mbit: float | None = None


@dataclass
class Host:
    """A host of the testbed: its namespace, its address, its link."""

    name: str
    ns: str
    address: str
    port: str  # its veth's end on the bridge, in the bridge's namespace
    link: Link = field(default_factory=Link)
    # Faults on its link (``Testbed.cut``, ``cut_between``, ``lose``): nft rules by name.
    faults: dict[str, str] = field(default_factory=dict)
    processes: list[subprocess.Popen[str]] = field(default_factory=list)
    # The process delaying its packets (``Testbed.delay``), if any.
    delayer: subprocess.Popen[str] | None = None

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside this host."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: IO[str] | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen[str]:
        """A process inside this host (its own session: signals to it reach its children);
        its stdout piped to the caller, its stderr to ``log`` (else discarded)."""
        process = subprocess.Popen(
            self.command(argv),
            env={**os.environ, **(env or {})},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=log if log is not None else subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def run(
        self, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A command inside this host, to its end (``timeout`` seconds at most)."""
        return subprocess.run(
            self.command(argv),
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def kill(self) -> None:
        """The host dies: every process in its namespace killed at once (SIGKILL). Its disk
        goes with it: the directories its reapers' watchdogs (killed too) would have removed,
        engine servers' scratch directories, are removed from the temporary directory the
        hosts share."""
        orphaned = _watched_directories(pids_in(self.ns))
        for process in self.processes:  # each started in a session (and group) of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for pid in pids_in(self.ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        _remove(orphaned)
        self.processes.clear()


class Testbed:
    """Hosts on one bridge (see the module's docstring). Use as a context manager."""

    __test__ = False  # not a test class, whatever pytest makes of its name

    def __init__(self, mtu: int = 1500) -> None:
        check_available()
        sweep_stale()
        self.mtu = mtu
        self.run_id = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.hosts: list[Host] = []
        self._bridge_ns = f"{self.run_id}-net"
        self._closed = False
        ip("netns", "add", self._bridge_ns)
        atexit.register(self.close)
        try:
            ip("link", "add", "br0", "type", "bridge", ns=self._bridge_ns)
            ip("link", "set", "br0", "up", ns=self._bridge_ns)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(
        self, name: str, rate_mbit: float | None = None, up_mbit: float | None = None
    ) -> Host:
        """A new host named ``name``, its link shaped to ``rate_mbit`` down (and up, unless
        ``up_mbit`` says otherwise); None: unshaped."""
        index = len(self.hosts)
        host = Host(
            name=name,
            ns=f"{self.run_id}-{name}",
            address=f"{SUBNET}.{FIRST_HOST + index}",
            port=f"p{index}",
        )
        ip("netns", "add", host.ns)
        self.hosts.append(host)
        ip("link", "add", "eth0", "netns", host.ns, "mtu", str(self.mtu), "type", "veth",
           "peer", "name", host.port, "netns", self._bridge_ns, "mtu", str(self.mtu))  # fmt: skip
        ip("link", "set", host.port, "master", "br0", ns=self._bridge_ns)
        ip("link", "set", host.port, "up", ns=self._bridge_ns)
        ip("addr", "add", f"{host.address}/24", "dev", "eth0", ns=host.ns)
        ip("link", "set", "eth0", "up", ns=host.ns)
        ip("link", "set", "lo", "up", ns=host.ns)
        for ns in (host.ns, self._bridge_ns):
            if routes := default_routes(ns):
                raise CommandFailed(f"namespace {ns} has a default route: {routes}")
        self.shape(host, rate_mbit, up_mbit)
        return host

    def shape(self, host: Host, rate_mbit: float | None, up_mbit: float | None = None) -> None:
        """``host``'s link at ``rate_mbit`` down and ``up_mbit`` (default: the same) up, by a
        token bucket on each end of its veth (None: unshaped)."""
        up = rate_mbit if up_mbit is None else up_mbit
        for ns, device, rate in ((host.ns, "eth0", up), (self._bridge_ns, host.port, rate_mbit)):
            tc("qdisc", "del", "dev", device, "root", ns=ns, check=False)
            if rate is not None:
                tc("qdisc", "add", "dev", device, "root", "tbf", *_bucket(rate), ns=ns)
        host.link = Link(down_mbit=rate_mbit, up_mbit=up)

    def received_bytes(self, host: Host) -> int:
        """Bytes the network delivered to ``host`` so far (its link's download)."""
        return self._port_counter(host, "tx")

    def sent_bytes(self, host: Host) -> int:
        """Bytes ``host`` put on the network so far (its link's upload)."""
        return self._port_counter(host, "rx")

    def _port_counter(self, host: Host, which: str) -> int:
        (link,) = json.loads(ip("-s", "-j", "link", "show", host.port, ns=self._bridge_ns))
        return int(link["stats64"][which]["bytes"])

    # Faults: each heals what it did; ``heal_all`` heals every host.

    def cut(self, host: Host, how: str = "drop") -> None:
        """``host`` partitioned from everyone: its link drops every packet (``drop``: the
        host and its peers see silence, as behind a dead switch) or goes down (``down``: the
        host sees no carrier)."""
        if how == "down":
            ip("link", "set", host.port, "down", ns=self._bridge_ns)
        elif how == "drop":
            host.faults["cut"] = "drop"
            self._apply_faults(host)
        else:
            raise ValueError(f"cut how={how!r}: 'drop' or 'down'")

    def heal(self, host: Host) -> None:
        """Undoes ``cut``, ``cut_between`` and ``lose`` on ``host``'s link."""
        ip("link", "set", host.port, "up", ns=self._bridge_ns)
        host.faults.clear()
        self._apply_faults(host)

    def cut_between(self, a: Host, b: Host) -> None:
        """``a`` and ``b`` partitioned from each other (each drops what goes to or comes from
        the other); both still reach everyone else."""
        a.faults[f"pair {b.address}"] = f"ip daddr {b.address} drop"
        b.faults[f"pair {a.address}"] = f"ip daddr {a.address} drop"
        self._apply_faults(a)
        self._apply_faults(b)

    def heal_between(self, a: Host, b: Host) -> None:
        a.faults.pop(f"pair {b.address}", None)
        b.faults.pop(f"pair {a.address}", None)
        self._apply_faults(a)
        self._apply_faults(b)

    def lose(self, host: Host, percent: float) -> None:
        """``host``'s link drops ``percent`` of its packets at random, each way (0: none)."""
        if percent <= 0:
            host.faults.pop("loss", None)
        else:
            host.faults["loss"] = f"numgen random mod 10000 < {round(percent * 100)} drop"
        self._apply_faults(host)

    def heal_all(self) -> None:
        for host in self.hosts:
            self.heal(host)
            self.delay(host, 0)

    def delay(self, host: Host, ms: float) -> None:
        """Every packet ``host`` sends waits ``ms`` milliseconds first (0: none): between two
        hosts delayed so, the round trip grows by twice that. A queue of the kernel
        (NFQUEUE) holds the packets and ``testbed.delay``, inside the host, lets them go."""
        if host.delayer is not None:
            run(host.command(["iptables", "-D", "OUTPUT", "-o", "eth0", *_QUEUE]), check=False)
            host.delayer.kill()
            host.delayer.wait(timeout=10)
            host.delayer = None
        if ms <= 0:
            return
        command = [sys.executable, "-m", "testbed.delay", "--ms", f"{ms:g}"]
        host.delayer = host.popen(command, env={"PYTHONPATH": str(_ROOT)})
        assert host.delayer.stdout is not None
        if host.delayer.stdout.readline().strip() != "delaying":
            raise CommandFailed(f"testbed.delay did not start on {host.name}")
        run(host.command(["iptables", "-A", "OUTPUT", "-o", "eth0", *_QUEUE]))

    def _apply_faults(self, host: Host) -> None:
        """``host``'s faults as one nft table on its port of the bridge, replaced atomically.

        Dropped where a switch drops them, not in the host: a packet its own kernel could not
        send is a local failure to TCP (no backoff; a socket with new data to send gives up
        after 15 probes half a second apart, ~7.5 s), which no partition in a network is. What
        the host sends arrives at the port's ingress, what it receives leaves by its egress."""
        rules = list(host.faults.values())
        to_host = [r.replace("daddr", "saddr") if r.startswith("ip daddr") else r for r in rules]
        table = f"faults_{host.port}"
        body = f"table netdev {table}\ndelete table netdev {table}\n"
        if rules:
            body += (
                f"table netdev {table} {{\n"
                f'  chain from_host {{ type filter hook ingress device "{host.port}" priority 0;\n'
                + "".join(f"    {rule}\n" for rule in rules)
                + "  }\n"
                f'  chain to_host {{ type filter hook egress device "{host.port}" priority 0;\n'
                + "".join(f"    {rule}\n" for rule in to_host)
                + "  }\n}\n"
            )
        nft(body, self._bridge_ns)

    def close(self) -> None:
        """Kills every process on every host, then removes the namespaces (their veths and
        the bridge go with them). Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        try:
            for host in self.hosts:
                host.kill()
        finally:  # whatever a host's end raised, no namespace outlives the testbed
            remove_namespaces([h.ns for h in self.hosts] + [self._bridge_ns])
            atexit.unregister(self.close)


def _bucket(rate_mbit: float) -> list[str]:
    """tbf's parameters for ``rate_mbit``: a burst of 4 ms at the rate (at least 64 KiB, the
    largest segment veth hands a qdisc) and a queue of 100 ms."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(int(rate_bytes * 0.004), 64 << 10)
    return ["rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "100ms"]


def remove_namespaces(names: Sequence[str], timeout: float = 20.0) -> None:
    """Kills what lives in each namespace and removes it (its veth ends and a bridge in it
    go with it)."""
    doomed = [pid for ns in names for pid in pids_in(ns)]
    orphaned = _watched_directories(doomed)
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    for ns in names:
        while pids_in(ns) and time.monotonic() < deadline:
            time.sleep(0.05)
        ip("netns", "del", ns, check=False)
    _remove(orphaned)


def _watched_directories(pids: Sequence[int]) -> list[Path]:
    """What the reapers' watchdogs among ``pids`` are to remove (``servers.common.reaper``):
    read before they are killed, removed after (see ``Host.kill``)."""
    return [path for pid in pids if (path := reaper.watchdog_directory(pid)) is not None]


def _remove(directories: Sequence[Path]) -> None:
    for path in directories:
        shutil.rmtree(path, ignore_errors=True)


def sweep_stale() -> None:
    """Removes the namespaces of testbeds whose process is gone (a run killed before its
    ``close``)."""
    stale = []
    for ns in namespaces():
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            stale.append(ns)
    if stale:
        remove_namespaces(stale)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
