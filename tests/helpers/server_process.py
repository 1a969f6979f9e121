"""One engine server as a process of its own, as an operator starts it, with its lifecycle
lines (``servers.common.process.announce``) read as they come: the one process helper of the
tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from servers.common.process import read_announcement

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
# Put before a command: it starts the way a script's background job does (``cmd &``), with
# SIGINT ignored on entry, which a program must undo itself to stop on Ctrl-C.
WITH_SIGINT_IGNORED = ("sh", "-c", "trap '' INT; exec \"$@\"", "sh")


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (a zombie is not)."""
    found = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


class ServerProcess:
    """``python -m servers.engine --port 0 ARGS`` (or ``command``, e.g. the ``skyrl-grpc``
    launcher and ``serve``); ``stderr``: a file for its logs (default: dropped)."""

    def __init__(
        self,
        *args: str,
        command: tuple[str, ...] = ("-m", "servers.engine"),
        stderr: Path | None = None,
    ) -> None:
        launcher = [sys.executable, *command] if command[0] == "-m" else list(command)
        self.started = time.monotonic()
        self._stderr = open(stderr, "w") if stderr else None
        self.proc = subprocess.Popen(
            [*launcher, "--port", "0", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self._stderr or subprocess.DEVNULL,
            text=True,
            env=ENV,
        )
        # Every lifecycle event so far, with the seconds since start it arrived at.
        self.events: list[tuple[float, dict[str, Any]]] = []

    def next_event(self) -> dict[str, Any] | None:
        """The next lifecycle event, or None once the process closed its stdout."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = read_announcement(line)
            if event is not None:
                self.events.append((time.monotonic() - self.started, event))
                return event
        return None

    def until(self, name: str) -> dict[str, Any]:
        """Reads events up to the first named ``name``."""
        while (event := self.next_event()) is not None:
            if event["event"] == name:
                return event
        raise AssertionError(f"exited before {name!r} (code {self.proc.wait()}): {self.events}")

    @property
    def address(self) -> str:
        """Where it listens (read from its "listening" line, waiting for it if need be)."""
        for _, event in self.events:
            if event["event"] == "listening":
                return str(event["address"])
        return str(self.until("listening")["address"])

    def descendants(self) -> list[psutil.Process]:
        children: list[psutil.Process] = psutil.Process(self.proc.pid).children(recursive=True)
        return children

    def kill(self) -> None:
        """SIGKILL (its engine's processes die with it: the server's reaper)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self._stderr is not None:
            self._stderr.close()
