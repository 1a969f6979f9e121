"""A fleet on this machine: N engine-server processes and a router process.

``LocalFleet`` launches each piece with ``python -m`` and reads the JSON lifecycle lines they
print (``listening``, ``ready``), so it knows addresses without guessing ports. Teardown sends
SIGTERM (drain), then SIGKILL to anything left, so no process outlives the stack.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from . import Fleet, FleetAddresses

ENGINE_MODULE = "servers.engine"
ROUTER_MODULE = "servers.router"


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen[str]
    events: list[dict[str, str]] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    listening: threading.Event = field(default_factory=threading.Event)

    def pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.events.append(event)
            if event.get("event") == "listening":
                self.listening.set()
            if event.get("event") in ("ready", "failed"):
                self.ready.set()
        self.listening.set()
        self.ready.set()

    def event(self, name: str) -> dict[str, str] | None:
        return next((e for e in self.events if e.get("event") == name), None)


class LocalFleet(Fleet):
    """N engine servers + a router as local processes. Use as a context manager."""

    def __init__(
        self,
        num_servers: int = 2,
        engine_args: list[str] | None = None,
        router_args: list[str] | None = None,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.num_servers = num_servers
        self.engine_args = engine_args or []
        self.router_args = router_args or []
        self.log_dir = log_dir
        self.env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            **(env or {}),
        }
        self._processes: list[_Process] = []

    def _spawn(self, name: str, module: str, args: list[str]) -> _Process:
        stderr: int | IO[str] = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(self.log_dir / f"{name}.log", "w")
        popen = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=self.env,
            start_new_session=True,  # SIGTERM/SIGKILL reach the engine's own child processes
        )
        process = _Process(name, popen)
        threading.Thread(target=process.pump, daemon=True).start()
        self._processes.append(process)
        return process

    def start(self, timeout: float = 600) -> FleetAddresses:
        servers = [
            self._spawn(f"server-{i}", ENGINE_MODULE, ["--port", "0", *self.engine_args])
            for i in range(self.num_servers)
        ]
        deadline = time.monotonic() + timeout
        server_addresses = []
        for server in servers:
            server.ready.wait(max(deadline - time.monotonic(), 0))
            ready = server.event("ready")
            if ready is None:
                self.close()
                raise RuntimeError(
                    f"{server.name} did not become ready (exit code {server.popen.poll()})"
                )
            server_addresses.append(ready["address"])
        router = self._spawn(
            "router",
            ROUTER_MODULE,
            ["--port", "0", "--backends", ",".join(server_addresses), *self.router_args],
        )
        router.listening.wait(max(deadline - time.monotonic(), 0))
        listening = router.event("listening")
        if listening is None:
            self.close()
            raise RuntimeError(f"the router did not start (exit code {router.popen.poll()})")
        self.addresses = FleetAddresses(listening["address"], tuple(server_addresses))
        self._wait_router_serving(deadline)
        return self.addresses

    def _wait_router_serving(self, deadline: float) -> None:
        """Waits until the router's health watches see every backend healthy."""
        import grpc

        from skyrl_grpc.v1 import router_pb2, router_pb2_grpc

        with grpc.insecure_channel(self.addresses.router) as channel:
            admin = router_pb2_grpc.RouterAdminStub(channel)
            while True:
                try:
                    listed = admin.ListBackends(router_pb2.ListBackendsRequest(), timeout=5)
                    states = [b.state for b in listed.backends]
                    if states and all(s == router_pb2.BACKEND_STATE_HEALTHY for s in states):
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("the router never saw a healthy backend")
                time.sleep(0.1)

    def kill_server(self, index: int) -> None:
        """SIGKILL one engine server and its engine processes (for fault tests)."""
        process = self._processes[index]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.popen.pid, signal.SIGKILL)
        process.popen.wait()

    def restart_server(self, index: int, timeout: float = 600) -> str:
        """Starts engine server ``index`` again on its old port; returns once it is ready."""
        port = self.addresses.servers[index].rpartition(":")[2]
        process = self._spawn(
            f"server-{index}-restarted",
            ENGINE_MODULE,
            ["--port", port, *self.engine_args],
        )
        process.ready.wait(timeout)
        if process.event("ready") is None:
            raise RuntimeError(
                f"server {index} did not come back (exit code {process.popen.poll()})"
            )
        return self.addresses.servers[index]

    @property
    def pids(self) -> list[int]:
        return [p.popen.pid for p in self._processes]

    def close(self, grace: float = 15) -> None:
        for process in reversed(self._processes):
            if process.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in self._processes:
            try:
                process.popen.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.popen.pid, signal.SIGKILL)  # the engine's children too
            process.popen.wait()
        self._processes.clear()
