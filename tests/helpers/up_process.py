"""``skyrl-grpc up`` as a process in a test: its output lines collected, waited on, and
typed to."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers.server_process import ENV, ROOT, WITH_SIGINT_IGNORED
from tests.helpers.waits import ENGINE_START_SECONDS


class Up:
    """``skyrl-grpc up`` as a process, its output lines collected by a thread. Started as a
    script's background job is (``skyrl-grpc up &``): with SIGINT ignored on entry, which a
    program must undo itself to stop on Ctrl-C."""

    def __init__(
        self,
        log_dir: Path,
        servers: int = 2,
        start_timeout: float = ENGINE_START_SECONDS,
        server_flags: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.proc = subprocess.Popen(
            [
                *WITH_SIGINT_IGNORED,
                sys.executable,
                "-m",
                "servers.cli",
                "up",
                "--servers",
                str(servers),
                "--router-port",
                "0",
                "--base-port",
                "0",
                "--log-dir",
                str(log_dir),
                # up's own bound on each server's start, as generous as the tests' own.
                "--start-timeout",
                str(start_timeout),
                *server_flags,  # up passes these to every server
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=ENV,
            process_group=0,  # killpg reaches up alone; this session, as LocalFleet's servers
        )
        self.lines: list[str] = []
        self._closed = False  # up's stdout ended: it exited, no line will come
        self._new_line = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line.rstrip())
                self._new_line.notify_all()
        with self._new_line:
            self._closed = True
            self._new_line.notify_all()

    def wait_for(self, fragment: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._new_line:
            while not any(fragment in line for line in self.lines):
                left = deadline - time.monotonic()
                assert left > 0, f"no {fragment!r} from up in {timeout} s: {self.lines}"
                # As ServerProcess.until: a launcher that gave up is not waited out.
                assert not self._closed, f"up exited before {fragment!r}: {self.lines}"
                self._new_line.wait(left)
            return next(line for line in self.lines if fragment in line)

    def output(self, timeout: float) -> list[str]:
        """Every line up printed, once its output has ended (it exited)."""
        with self._new_line:
            assert self._new_line.wait_for(lambda: self._closed, timeout), self.lines
            return list(self.lines)

    def type(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> bool:
        """SIGINT (Ctrl-C), then SIGKILL 60 s later; False if it took the SIGKILL."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                return False
        return True
