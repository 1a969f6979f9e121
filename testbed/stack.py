"""This stack's processes on testbed hosts, as an operator starts them on machines of their own:
``python -m servers.engine --host <the host's address>`` and ``python -m servers.router``, each
inside its host's namespace, their lifecycle lines (``servers.common.process.announce``) read
for the address they listen on and their readiness; and the jobs a workload runs on a host
(``python -m testbed.jobs``), their one JSON result line read back."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from servers.common.process import read_announcement
from testbed import Host

ROOT = Path(__file__).resolve().parents[1]
# The stack's processes on a host: this checkout's code; a Ray driver among them (``up --ray``)
# speaks to the testbed's Ray cluster without token authentication, as its nodes run.
ENGINE_ENV = {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
START_SECONDS = 300.0
JOB_RESULT = "JOB-RESULT "
T = TypeVar("T")


@dataclass
class _Output:
    """A process on a host whose standard output a thread of its own reads, line by line
    (``_take``); ``_wait`` blocks until what it looks for has come."""

    host: Host
    popen: subprocess.Popen[str]
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._changed:
                if self._take(line.rstrip("\n")):
                    self._changed.notify_all()
        with self._changed:
            self._take(None)
            self._changed.notify_all()

    def _take(self, line: str | None) -> bool:
        """Keeps what ``line`` says (None: the process's output ended); True if it kept any."""
        raise NotImplementedError

    def _wait(self, found: Callable[[], T | None], what: str, timeout: float) -> T:
        deadline = time.monotonic() + timeout
        with self._changed:
            while (result := found()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.host.name}: no {what} in {timeout:.0f} s")
                self._changed.wait(left)
            return result


@dataclass
class Process(_Output):
    """A stack process on a host, its lifecycle events read as it prints them."""

    events: list[dict[str, Any]] = field(default_factory=list)

    def _take(self, line: str | None) -> bool:
        event = {"event": "exited"} if line is None else read_announcement(line)
        if event is not None:
            self.events.append(event)
        return event is not None

    def until(self, name: str, timeout: float = START_SECONDS) -> dict[str, Any]:
        """The first event named ``name`` (raises if the process fails or exits first)."""

        def found() -> dict[str, Any] | None:
            for event in self.events:
                if event["event"] == name:
                    return event
                if event["event"] in ("failed", "exited"):
                    raise RuntimeError(f"{self.host.name}: {event} before {name!r}")
            return None

        return self._wait(found, repr(name), timeout)

    @property
    def address(self) -> str:
        return str(self.until("listening")["address"])


def _log(log_dir: Path | None, name: str) -> IO[str] | None:
    if log_dir is None:
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    return open(log_dir / f"{name}.log", "a")


def start_server(
    host: Host, *flags: str, port: int = 50051, log_dir: Path | None = None
) -> Process:
    """An engine server on ``host``, listening on its address (not yet ready: ``until``)."""
    argv = [sys.executable, "-m", "servers.engine", "--host", host.address, "--port", str(port)]
    popen = host.popen([*argv, *flags], ENGINE_ENV, _log(log_dir, host.name), ROOT)
    return Process(host, popen)


def start_router(
    host: Host,
    backends: Sequence[str],
    *flags: str,
    port: int = 50050,
    log_dir: Path | None = None,
) -> Process:
    """A router on ``host`` in front of ``backends`` (host:port each)."""
    argv = [sys.executable, "-m", "servers.router", "--host", host.address, "--port", str(port)]
    argv += ["--backends", ",".join(backends)]
    popen = host.popen([*argv, *flags], ENGINE_ENV, _log(log_dir, f"{host.name}-router"), ROOT)
    return Process(host, popen)


@dataclass
class Printed(_Output):
    """A process on a host read by the lines it prints (``lines``: seconds on the host's
    monotonic clock, and the line)."""

    lines: list[tuple[float, str]] = field(default_factory=list)
    # What the process is called when it exits too soon.
    name = "the process"

    def _take(self, line: str | None) -> bool:
        self.lines.append((time.monotonic(), "EXITED" if line is None else line))
        return True

    def until(self, words: str, timeout: float = START_SECONDS, after: float = 0.0) -> str:
        """The first line holding ``words`` printed at or after ``after`` (raises if ``up``
        exits first, or none comes within ``timeout`` seconds)."""

        def found() -> str | None:
            for at, line in self.lines:
                if at >= after and words in line:
                    return line
                if line == "EXITED":
                    raise RuntimeError(f"{self.name} on {self.host.name} exited before {words!r}")
            return None

        return self._wait(found, repr(words), timeout)

    def printed(self, words: str, after: float = 0.0) -> list[str]:
        with self._changed:
            return [line for at, line in self.lines if at >= after and words in line]


@dataclass
class Up(Printed):
    """``skyrl-grpc up`` on a host, as an operator runs it: every line it prints."""

    name = "up"

    def started(self) -> tuple[str, list[str]]:
        """The router's address and the servers' (once the fleet is up)."""
        self.until("Ctrl-C to stop")
        router = self.until("router: ").split(": ", 1)[1]
        servers = [line.split(": ", 1)[1] for line in self.printed("server ") if ": " in line]
        return router, [s for s in servers if s[0].isdigit()]


def start_up(host: Host, *flags: str, env: dict[str, str] | None = None) -> Up:
    """``skyrl-grpc up`` with ``flags`` on ``host`` (its output read line by line: ``Up``)."""
    argv = [str(Path(sys.executable).with_name("skyrl-grpc")), "up", *flags]
    popen = host.popen(argv, {**ENGINE_ENV, **(env or {})}, None, ROOT)
    return Up(host, popen)


def run_job(host: Host, job: str, arguments: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``python -m testbed.jobs JOB`` on ``host`` with ``arguments``: its result."""
    done = host.run(
        [sys.executable, "-m", "testbed.jobs", job, json.dumps(arguments)],
        timeout=timeout,
        env={"PYTHONPATH": str(ROOT)},
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(JOB_RESULT):
            result: dict[str, Any] = json.loads(line[len(JOB_RESULT) :])
            return result
    raise RuntimeError(
        f"job {job} on {host.name} gave no result (exit {done.returncode}): {done.stderr[-3000:]}"
    )


def start_job(
    host: Host, job: str, arguments: dict[str, Any], log_dir: Path | None = None
) -> subprocess.Popen[str]:
    """``run_job`` started, not waited for: the process, whose stdout ends with the result
    (``job_result``); its stderr goes to ``log_dir``'s ``<host>-<job>.log``."""
    argv = [sys.executable, "-m", "testbed.jobs", job, json.dumps(arguments)]
    return host.popen(argv, {"PYTHONPATH": str(ROOT)}, _log(log_dir, f"{host.name}-{job}"), ROOT)


def job_result(process: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """What a started job came to (its stderr went to the log ``start_job`` was given)."""
    out, _ = process.communicate(timeout=timeout)
    for line in reversed(out.splitlines()):
        if line.startswith(JOB_RESULT):
            result: dict[str, Any] = json.loads(line[len(JOB_RESULT) :])
            return result
    raise RuntimeError(f"a job gave no result (exit {process.returncode}): {out[-2000:]}")
