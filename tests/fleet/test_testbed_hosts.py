"""The testbed's hosts themselves (``testbed``), where a fault does more than a packet filter."""

from __future__ import annotations

import sys
from pathlib import Path

from servers.common import reaper
from servers.engine.process import scratch
from testbed.netns import pids_in
from testbed.stack import ROOT
from tests.helpers.hosts import open_testbed

# An engine server's start as far as its scratch directory goes: the directory made, its
# reaper's watchdog started (a process of the host too), the directory printed.
_SERVER_START = """
import time
from servers.common.reaper import reap_children_on_exit
from servers.engine.process.scratch import use_scratch_directory
directory = use_scratch_directory()
reap_children_on_exit(remove=directory)
print(directory, flush=True)
time.sleep(300)
"""


def test_a_hosts_death_takes_its_servers_scratch_directories_with_it() -> None:
    """Hosts share this machine's temporary directory; a host's death kills every process in
    it, the servers' watchdogs too, so the testbed removes what they would have. Without it
    killed hosts left their servers' directories behind for good (20 in one run of the suite),
    and an actor of a later test could bear a reused process ID of theirs."""
    with open_testbed() as bed:
        host = bed.add_host("h", 200)
        server = host.popen([sys.executable, "-c", _SERVER_START], cwd=ROOT)
        assert server.stdout is not None
        directory = Path(server.stdout.readline().strip())
        assert directory.is_dir() and directory.name.startswith(f"{scratch.PREFIX}{server.pid}-")
        (watchdog,) = [p for p in pids_in(host.ns) if reaper.watchdog_directory(p) is not None]
        assert reaper.watchdog_directory(watchdog) == directory
        host.kill()
        assert server.poll() is not None
        assert not directory.exists()
