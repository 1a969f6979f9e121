"""A fleet on this machine: N engine-server processes and a router process, supervised.

``LocalFleet`` launches each piece with ``python -m`` and reads the JSON lifecycle lines they
print on stdout (``listening``, ``ready``, ``failed``), so it knows addresses without guessing
ports. Each process's log (its stderr, and its lifecycle lines) goes to a file of its own when
a log directory is given.

With ``supervise()``, a server that dies (its engine died, it was killed, it ran out of memory)
is reported and started again on the same address by the fleets' one rule
(``supervision.ServerSupervisor``: backoff, a crash loop reported and left down), reading the
fleet's current weights from the other servers before it serves (``--catch-up-from``); the
router re-admits it when its health check passes and moves the server's sessions back. The router is
supervised by the same rule: started again on the same gRPC, HTTP and metrics ports, with the
fleet's current servers; it learns where each session lives from the servers' own status feeds
(``ServerStatus``), so sessions keep their servers and their KV cache.

Teardown sends SIGTERM (drain), then SIGKILL to anything left, so no process outlives the fleet;
and if the fleet's own process dies first (SIGKILL, out of memory), its processes end themselves
(``reaper.exit_with_supervisor``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from servers.common.process import read_announcement, with_flag
from servers.common.reaper import EXIT_WITH_SUPERVISOR
from servers.common.supervision import RestartPolicy, ServerSupervisor
from servers.fleet import ROUTED_EXPERTS_FLAG, Fleet, FleetAddresses, FleetStartFailed
from servers.fleet.seeds import SEED_FLAG, fleet_seed, server_seed
from servers.fleet.standbys import StandbyRoles
from skyrl_grpc.tiny_model import embedded_model_path

ENGINE_MODULE = "servers.engine"
ROUTER_MODULE = "servers.router"


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen[str]
    log: IO[str] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    listening: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)

    def pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if self.log is not None:
                self.log.write(line)
                self.log.flush()
            event = read_announcement(line)
            if event is None:
                continue
            self.events.append(event)
            if event.get("event") == "listening":
                self.listening.set()
            if event.get("event") in ("ready", "failed"):
                self.ready.set()
        self.listening.set()
        self.ready.set()

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == name), None)


def served_model_directory(engine_args: Sequence[str]) -> str:
    """The model directory servers started with ``engine_args`` serve (``--model``, read by
    the serve command's own parser, else the embedded tiny model's)."""
    from servers.engine.options import build_parser

    parsed, _ = build_parser().parse_known_args(list(engine_args))
    return str(embedded_model_path(parsed.model) or parsed.model)


class LocalFleet(Fleet):
    """N engine servers + a router as local processes. Use as a context manager.

    ``server_ports``: one port per server (0: any free port, the default); ``router_port``
    likewise. ``on_event`` receives one line per supervision event (a server died, is back).
    ``start_timeout``: seconds a server may take to become ready (``Fleet.start_timeout``).
    ``standby``: warm standbys started beside the ``num_servers`` that serve (``standbys``);
    ``server_ports`` then lists a port for each of them too.
    """

    def __init__(
        self,
        num_servers: int = 2,
        engine_args: list[str] | None = None,
        router_args: list[str] | None = None,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        *,
        host: str = "127.0.0.1",
        server_ports: Sequence[int] | None = None,
        router_port: int = 0,
        on_event: Callable[[str], None] | None = None,
        restart_policy: RestartPolicy | None = None,
        start_timeout: float = Fleet.start_timeout,
        server_metrics: bool = False,
        standby: int = 0,
    ) -> None:
        # Every server started, the standbys too (they are the last ``standby``).
        num_servers += standby
        self.num_servers = num_servers
        self.roles = StandbyRoles.last(standby, num_servers)
        self.start_timeout = start_timeout
        self.engine_args = engine_args or []
        self.router_args = router_args or []
        if "--tokenizer" not in self.router_args:
            # The router's edge tokenizes text prompts with the served model's own files (on
            # this host: the servers read them from there too).
            self.router_args += ["--tokenizer", served_model_directory(self.engine_args)]
        if ROUTED_EXPERTS_FLAG in self.engine_args and "--routed-experts" not in self.router_args:
            self.router_args += ["--routed-experts"]  # the edge returns what servers capture
        self.log_dir = log_dir
        self.host = host
        self.server_ports = list(server_ports or [0] * num_servers)
        if len(self.server_ports) != num_servers:
            raise ValueError(f"{len(self.server_ports)} server ports for {num_servers} servers")
        self.router_port = router_port
        self.on_event = on_event or (lambda line: print(line, flush=True))
        self.env = {
            **os.environ,
            **(env or {}),
        }
        self._servers: list[_Process] = []
        self._router: _Process | None = None
        self._closing = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._router_supervisor: threading.Thread | None = None
        self.router_supervision: ServerSupervisor | None = None
        self.restart_policy = restart_policy or RestartPolicy()
        self.metrics_port: int | None = None
        # Each server's /metrics port (None: not asked for; 0 until it first listens): a
        # restarted server serves them where it did.
        self.server_metrics_ports: list[int | None] = [
            0 if server_metrics else None for _ in range(num_servers)
        ]
        self.http_port: int | None = None  # the router's OpenAI HTTP edge, if it has one

    def _spawn(self, name: str, module: str, args: list[str]) -> _Process:
        log: IO[str] | None = None
        stderr: int | IO[str] = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{name}.log", "a")  # closed with the fleet
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name}\n")
            log.flush()
            stderr = log
        popen = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            # Held open by this process and never written: it closes when this process dies,
            # and the child then ends itself (``reaper.exit_with_supervisor``).
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**self.env, EXIT_WITH_SUPERVISOR: "1"},
            # A process group of its own, so SIGTERM/SIGKILL reach the engine's own child
            # processes too; in this process's session, not a new one: on Linux a session is
            # a scheduler autogroup, and a busy host was measured to starve a lone one (a
            # server's start stalled for 15 minutes under a loaded test pass; a busy loop in a
            # session of its own got 1.4 s of CPU in 20 s beside one in the busy session's 7.6 s).
            process_group=0,
        )
        process = _Process(name, popen, log)
        threading.Thread(target=process.pump, daemon=True).start()
        return process

    def _spawn_server(self, index: int, catch_up: bool = False) -> _Process:
        """Server ``index``; with ``catch_up``, it reads the fleet's current weights from the
        other servers before it serves (a restarted or added server)."""
        args = ["--host", self.host, "--port", str(self.server_ports[index]), *self.engine_args]
        args = with_flag(args, SEED_FLAG, str(server_seed(fleet_seed(self.engine_args), index)))
        metrics = self._metrics_port_of(index)
        if metrics is not None:
            args = with_flag(args, "--metrics-port", str(metrics))
        peers = [a for i, a in enumerate(self.addresses.servers) if i != index]
        if catch_up and peers:
            args += ["--catch-up-from", ",".join(peers)]
        server = self._spawn(f"server-{index}", ENGINE_MODULE, args)
        if metrics == 0:  # learnt once it listens (``_remember_metrics_port``)
            threading.Thread(
                target=self._remember_metrics_port, args=(index, server), daemon=True
            ).start()
        return server

    def _metrics_port_of(self, index: int) -> int | None:
        ports = self.server_metrics_ports
        return ports[index] if index < len(ports) else None

    def _remember_metrics_port(self, index: int, server: _Process) -> None:
        server.listening.wait()
        listening = server.event("listening")
        port = listening.get("metrics_port") if listening else None
        if port and index < len(self.server_metrics_ports):
            self.server_metrics_ports[index] = int(port)

    def _await_ready(self, server: _Process, deadline: float) -> str:
        server.ready.wait(max(deadline - time.monotonic(), 0))
        ready = server.event("ready")
        if ready is None:
            failed = server.event("failed")
            code = server.popen.poll()
            if code is None and failed is None:  # loading still: out of time, not failed
                raise FleetStartFailed.still_starting(server.name)
            why = f": {failed.get('error')}" if failed and failed.get("error") else ""
            raise FleetStartFailed(f"{server.name} did not become ready (exit code {code}){why}")
        return str(ready["address"])

    def start(self, timeout: float | None = None) -> FleetAddresses:
        self._servers = [self._spawn_server(i) for i in range(self.num_servers)]
        deadline = time.monotonic() + self.start_bound(timeout)
        try:
            addresses = [self._await_ready(s, deadline) for s in self._servers]
        except FleetStartFailed:
            self.close()
            raise
        # Restarts reuse each server's address, so a router keeps it as the same backend.
        self.server_ports = [int(a.rpartition(":")[2]) for a in addresses]
        self.addresses = FleetAddresses("", tuple(addresses))
        try:
            router = self._start_router(deadline)
        except FleetStartFailed:
            self.close()
            raise
        self.addresses = FleetAddresses(router, tuple(addresses), self.roles.of(addresses))
        self._wait_router_serving(deadline)
        return self.addresses

    def _router_command(self) -> list[str]:
        """The router's arguments: the fleet's servers now, and (after its first start) the
        ports it listened on, so a restarted router is found where it was."""
        args = list(self.router_args)
        if self.http_port:
            args = with_flag(args, "--http-port", str(self.http_port))
        if self.metrics_port:
            args = with_flag(args, "--metrics-port", str(self.metrics_port))
        servers = ",".join(self.addresses.servers)
        standbys = self.roles.of(self.addresses.servers)
        if standbys:
            args += ["--standbys", ",".join(standbys)]
        return ["--host", self.host, "--port", str(self.router_port), "--backends", servers, *args]

    def _start_router(self, deadline: float) -> str:
        """Starts the router; returns its address once it listens."""
        router = self._spawn("router", ROUTER_MODULE, self._router_command())
        self._router = router
        router.listening.wait(max(deadline - time.monotonic(), 0))
        listening = router.event("listening")
        if listening is None:
            raise FleetStartFailed(f"the router did not start (exit code {router.popen.poll()})")
        address = str(listening["address"])
        self.router_port = int(address.rpartition(":")[2])
        self.metrics_port = listening.get("metrics_port")
        self.http_port = listening.get("http_port")
        return address

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
                    raise FleetStartFailed("the router never saw a healthy backend")
                time.sleep(0.1)

    # -- supervision --------------------------------------------------------------------------

    def supervise(self) -> None:
        """Starts restarting servers that die (in a background thread) until ``close()``."""
        if self._supervisor is not None:
            return
        self.supervision = ServerSupervisor(
            len(self._servers),
            death=self._death,
            restart=self.restart_server,
            on_event=self.on_event,
            policy=self.restart_policy,
            addresses=list(self.addresses.servers),
            sleep=self._closing.wait,
            on_death=self._promote_in_place_of,
        )
        self._supervisor = self.supervision.start(self._closing, 0.2, "fleet supervisor")
        self.router_supervision = ServerSupervisor(
            1,
            death=lambda _: self._router_death(),
            restart=lambda _: self.restart_router(),
            on_event=self.on_event,
            policy=self.restart_policy,
            noun="router",
            back_note="it routes to the fleet again; sessions keep their servers",
            addresses=[self.addresses.router],
            sleep=self._closing.wait,
        )
        self._router_supervisor = self.router_supervision.start(
            self._closing, 0.1, "router supervisor"
        )

    @property
    def restarts(self) -> list[int]:
        return self.supervision.restarts if self.supervision else [0] * len(self._servers)

    def _death(self, index: int) -> str | None:
        server = self._servers[index]
        code = server.popen.poll()
        if code is None or self._closing.is_set():
            return None
        failed = server.event("failed")
        why = f": {failed['error']}" if failed and failed.get("error") else ""
        return f"exit code {code}{why}"

    def _router_death(self) -> str | None:
        router = self._router
        if router is None or self._closing.is_set():
            return None
        code = router.popen.poll()
        return None if code is None else f"exit code {code}"

    def restart_router(self, timeout: float = 120) -> str:
        """Starts the router again on its old ports; returns its address once it listens."""
        deadline = time.monotonic() + timeout
        address = self._start_router(deadline)
        self.addresses = replace(self.addresses, router=address)
        return address

    # -- growth and shrinkage ------------------------------------------------------------------

    def _add_server(self, index: int, timeout: float) -> str:
        """A server on a free port (``scale``)."""
        self.server_ports.append(0)
        if any(port is not None for port in self.server_metrics_ports):
            self.server_metrics_ports.append(0)
        self._servers.append(self._spawn_server(index, catch_up=True))
        address = self._await_ready(self._servers[index], time.monotonic() + timeout)
        self.server_ports[index] = int(address.rpartition(":")[2])
        return address

    def _remove_server(self, index: int) -> None:
        self.server_ports.pop()
        if len(self.server_metrics_ports) > len(self.server_ports):
            self.server_metrics_ports.pop()
        self._stop([self._servers.pop()], grace=15)

    # -- for tests and tools ------------------------------------------------------------------

    def kill_server(self, index: int) -> None:
        """SIGKILL one engine server and its engine processes (for fault tests)."""
        process = self._servers[index]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.popen.pid, signal.SIGKILL)
        process.popen.wait()

    def kill_router(self) -> None:
        """SIGKILL the router (for fault tests)."""
        assert self._router is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._router.popen.pid, signal.SIGKILL)
        self._router.popen.wait()

    def restart_server(self, index: int, timeout: float | None = None) -> str:
        """Starts engine server ``index`` again on its old port, caught up with the others'
        weights (``servers.engine.peers.catch_up``); returns once it is ready."""
        self._servers[index] = self._spawn_server(index, catch_up=True)
        bound = self.start_bound(timeout)
        return self._await_ready(self._servers[index], time.monotonic() + bound)

    @property
    def pids(self) -> list[int]:
        """Process ids of the servers (in order), then the router."""
        processes = [*self._servers, *([self._router] if self._router else [])]
        return [p.popen.pid for p in processes]

    @staticmethod
    def _stop(processes: list[_Process], grace: float) -> None:
        """SIGTERM (drain), then SIGKILL to whatever is left, the engines' children too. The
        SIGTERM goes to the server alone, not its process group: vLLM's engine core aborts its
        requests at once on a SIGTERM of its own, cutting the calls the drain waits for (a
        self-routing client's calls the router's drain never saw); the server shuts its engine
        down once they ended."""
        for process in processes:
            if process.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(process.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(max(deadline - time.monotonic(), 0.1))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.popen.pid, signal.SIGKILL)
            process.popen.wait()
            if process.log is not None:
                process.log.close()

    def close(self, grace: float = 15) -> None:
        self._closing.set()
        for supervisor in (self._supervisor, self._router_supervisor):
            if supervisor is not None:
                supervisor.join(timeout=5)
        self._stop([*([self._router] if self._router else []), *self._servers], grace)
        self._servers.clear()
        self._router = None
