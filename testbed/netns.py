"""The commands a testbed runs as root: ``ip`` (namespaces, veth pairs, the bridge, routes),
``tc`` (each link's rate), ``nft`` (dropped packets: loss, a host or a pair cut off) and
``iptables`` (a delayed host's packets to its queue), each inside a namespace the testbed
made. One place runs them, so a failure says which command and
what it printed."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

# What a testbed needs, and the package that has it (Debian's names).
TOOLS = {"ip": "iproute2", "tc": "iproute2", "nft": "nftables", "iptables": "iptables"}


class TestbedUnavailable(RuntimeError):
    """This machine cannot host a testbed (not root, or a tool missing): one line saying why."""

    __test__ = False  # not a test class, whatever pytest makes of its name


class CommandFailed(RuntimeError):
    """A testbed command failed: the command and what it printed."""


def check_available() -> None:
    """Raises ``TestbedUnavailable`` naming what is missing."""
    if os.geteuid() != 0:
        raise TestbedUnavailable(
            "the testbed makes network namespaces and needs root (run as root, or in CI)"
        )
    missing = sorted({package for tool, package in TOOLS.items() if shutil.which(tool) is None})
    if missing:
        raise TestbedUnavailable(
            f"the testbed needs {', '.join(missing)} (apt-get install {' '.join(missing)}; "
            "scripts/setup.sh installs them)"
        )


def run(argv: Sequence[str], stdin: str | None = None, check: bool = True) -> str:
    """Runs one command; its output (raises ``CommandFailed`` when it fails and ``check``)."""
    done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise CommandFailed(f"{' '.join(argv)}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    return run(["ip", *(["-n", ns] if ns else []), *args], check=check)


def tc(*args: str, ns: str, check: bool = True) -> str:
    return run(["tc", "-n", ns, *args], check=check)


def nft(script: str, ns: str) -> None:
    """An nftables script, applied atomically inside namespace ``ns``."""
    run(["ip", "netns", "exec", ns, "nft", "-f", "-"], stdin=script)


def namespaces() -> list[str]:
    """The names of every network namespace ``ip netns`` knows."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def pids_in(ns: str) -> list[int]:
    """The processes living in namespace ``ns`` (what ``ip netns pids`` lists, read here from
    /proc: a process gone between the listing and its reading is skipped, and no command's
    timeout can leave a testbed's teardown half done)."""
    try:
        target = os.stat(f"/run/netns/{ns}")
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            inside = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (inside.st_dev, inside.st_ino) == (target.st_dev, target.st_ino):
            found.append(int(entry))
    return found


def default_routes(ns: str) -> list[str]:
    """Any default route of namespace ``ns`` (a testbed allows none, IPv4 or IPv6)."""
    routes = []
    for family in ("-4", "-6"):
        routes += [r for r in ip(family, "route", "show", "default", ns=ns).splitlines() if r]
    return routes
