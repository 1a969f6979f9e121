"""No orphans: the processes a server starts die with it, whatever kills it.

vLLM runs its engine in child processes (the engine core, a resource tracker). If the server is
killed with SIGKILL, or by the kernel for memory, nothing in it runs to stop them: they are
re-parented to init and keep their memory (1.7 GB resident for the tiny model's engine core;
GPU memory on a GPU machine) for good.

``reap_children_on_exit`` makes this process the leader of its own process group (which its
children inherit) and starts a tiny watchdog process outside that group, holding the read end
of a pipe whose write end only this process holds. When this process dies for any reason, the
kernel closes the pipe; the watchdog sees end-of-file and ends the group: SIGTERM (vLLM's
processes clean up their shared memory on it), then SIGKILL to whatever is left after a grace.
It costs one sleeping process of a few MB and no polling. Once the group is gone the watchdog
also removes the directory it was given: an engine server's scratch directory
(``servers.engine.process.scratch``), where vLLM's sockets and files of the dead processes would
otherwise stay.

One level up, a fleet's processes (engine servers, the router) die with the fleet that started
them: ``LocalFleet`` gives each a pipe as its standard input, holds the other end and sets
``EXIT_WITH_SUPERVISOR``; ``exit_with_supervisor`` in the process sends itself SIGTERM (a
drain, and then its own reaper's work) when that pipe reaches end-of-file, i.e. when the
fleet's process is gone however it died. Without it, a ``skyrl-grpc up`` killed with SIGKILL
left its whole fleet running, re-parented to init (2 GB resident per tiny-model server).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

# Set (to "1") by a supervisor that holds the other end of this process's standard input.
EXIT_WITH_SUPERVISOR = "SKYRL_GRPC_EXIT_WITH_SUPERVISOR"

# The watchdog's whole program: wait for the pipe to close, then end the process group.
_WATCHDOG = """
import os, shutil, signal, sys, time
group, grace, remove, detach = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
if detach == "1" and os.fork():
    os._exit(0)  # the rest runs in a child no longer the server's: see reap_children_on_exit
sys.stdin.buffer.read()  # returns when the server's end of the pipe closes: it is gone
def signal_group(sig):
    try:
        os.killpg(group, sig)
        return True
    except ProcessLookupError:
        return False
if signal_group(signal.SIGTERM):
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and signal_group(0):
        time.sleep(0.05)
    signal_group(signal.SIGKILL)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and signal_group(0):
        time.sleep(0.05)
if remove:
    shutil.rmtree(remove, ignore_errors=True)
"""


def reap_children_on_exit(
    grace_seconds: float = 2.0, remove: Path | None = None, detach: bool = False
) -> subprocess.Popen[bytes] | None:
    """Ends every process of this process's group once this process has died (see the module
    docstring), then removes the directory ``remove`` (the server's scratch directory, which
    they wrote to); returns the watchdog, or None where process groups do not exist.
    ``detach``: the watchdog is not this process's child (it forks and its parent exits), for
    a process whose children are killed with it (a Ray worker's are, by its raylet): the
    watchdog must outlive it. Then the process returned is the one that exited."""
    if os.name != "posix":
        return None
    try:
        if os.getpgrp() != os.getpid():
            os.setpgid(0, 0)  # a group of our own, so the watchdog ends only what we started
    except PermissionError:  # a session leader already leads its own group
        pass
    # A raw pipe, not a file object: nothing closes the write end until the kernel does, when
    # this process has exited (a file object could be closed by the interpreter's own
    # teardown, and the watchdog would then signal us while our exit code is being set).
    # os.pipe() descriptors are not inherited (O_CLOEXEC): only this process holds the end.
    read_end, _write_end = os.pipe()
    try:
        watchdog = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WATCHDOG,
                str(os.getpgrp()),
                str(grace_seconds),
                str(remove or ""),
                "1" if detach else "0",
            ],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            # Outside our group, which it must outlive; in our session (a new one would be a
            # scheduler autogroup of its own: see servers.fleet.local's _spawn).
            process_group=0,
        )
    finally:
        os.close(read_end)
    if detach:
        watchdog.wait()  # it forked the watchdog and exited at once
    return watchdog


def watchdog_directory(pid: int) -> Path | None:
    """The directory the watchdog ``pid`` is to remove once its server's group is gone; None
    if ``pid`` is no such watchdog (or is gone). For whoever kills a watchdog before its time
    (a testbed host's death kills every process on the host) and must do its last work."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    # Its command line: python -c _WATCHDOG group grace remove detach.
    if len(argv) < 7 or argv[1:3] != [b"-c", _WATCHDOG.encode()] or not argv[5]:
        return None
    return Path(os.fsdecode(argv[5]))


def exit_with_supervisor() -> None:
    """Where the process that started this one asked for it (``EXIT_WITH_SUPERVISOR``): once
    standard input reaches end-of-file (that process has died: it never writes and never
    closes it while alive), this process is sent SIGTERM. Returns at once; a daemon thread
    waits."""
    if os.environ.get(EXIT_WITH_SUPERVISOR) != "1":
        return
    # Not passed on: the engine's own child processes are ended by this process's reaper.
    del os.environ[EXIT_WITH_SUPERVISOR]

    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor watch", daemon=True).start()
