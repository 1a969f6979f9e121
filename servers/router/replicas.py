"""Router replicas: ``skyrl-grpc route --replicas N`` runs N router processes behind one gRPC
address and one HTTP address.

Every replica is a whole router (forwarding, multiplexing, batches, the HTTP edge, health,
migration, its own /metrics) listening on the same ports with ``SO_REUSEPORT``: the kernel
spreads new connections among the replicas that listen, so a dead replica's share goes to the
others at once. Replicas share no state: each follows every server's ServerStatus stream, the
servers' own record of the sessions they hold, and places a new session by the same
deterministic rule from the same membership (``skyrl_grpc.placement``), so a session's later
turns reach its server through any replica.

This process starts the replicas (as ``python -m servers.router`` with the same flags), says
``listening`` once all listen, and supervises them (``servers.common.supervision``: a replica
that dies is started again on the same ports, the first time after half a second). SIGTERM
stops them all. The replicas die with it however it dies (their standard input is a pipe only
it holds: ``servers.common.reaper``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import grpc

from servers.common.process import read_announcement, serve_until_stopped, with_flag
from servers.common.reaper import EXIT_WITH_SUPERVISOR
from servers.common.supervision import RestartPolicy, ServerSupervisor
from skyrl_grpc.process_group import free_port

log = logging.getLogger(__name__)

ROUTER_MODULE = "servers.router"
# Seconds a replica may take to listen.
START_SECONDS = 60.0
# Seconds a stopping replica gets to drain before it is killed.
STOP_SECONDS = 15.0
# A dead replica is back within a second or so: the others carry its share meanwhile.
REPLICA_RESTARTS = RestartPolicy(first_delay=0.5, max_delay=5.0)


class _Replica:
    """One replica's process and the lifecycle lines it printed."""

    def __init__(self, command: list[str]) -> None:
        self.popen = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, EXIT_WITH_SUPERVISOR: "1"},
            start_new_session=True,
        )
        self.listening = threading.Event()
        self.announced: dict[str, Any] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            event = read_announcement(line)
            if event is None:
                sys.stdout.write(line)
            elif event["event"] == "listening":
                self.announced = event
                self.listening.set()
        self.listening.set()


class RouterReplicas:
    """N replicas of the router the flags ``argv`` describe, on ``host:port`` (0: a free port)
    and, with ``http_port``, one HTTP port; replica i serves /metrics on ``metrics_port + i``
    (0: any free port)."""

    def __init__(
        self,
        argv: list[str],
        count: int,
        host: str,
        port: int,
        http_port: int | None,
        metrics_port: int | None,
    ) -> None:
        self._argv = argv
        self.count = count
        self.host = host
        self.port = port or free_port(host)
        self.http_port = None if http_port is None else http_port or free_port(host)
        self._metrics_port = metrics_port
        # Each replica's own port, where its siblings tell it membership changes.
        self.own_ports = [free_port(host) for _ in range(count)]
        self.replicas: list[_Replica] = []
        self._closing = threading.Event()
        self._stopped = asyncio.Event()
        self.supervision: ServerSupervisor | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _command(self, index: int) -> list[str]:
        args = with_flag(self._argv, "--replicas", "1")
        args = with_flag(args, "--replica-id", str(index))
        args = with_flag(args, "--port", str(self.port))
        args = with_flag(args, "--host", self.host)
        args = with_flag(args, "--replica-ports", ",".join(map(str, self.own_ports)))
        if self.http_port is not None:
            args = with_flag(args, "--http-port", str(self.http_port))
        if self._metrics_port is not None:
            port = self._metrics_port + index if self._metrics_port else 0
            args = with_flag(args, "--metrics-port", str(port))
        return [sys.executable, "-m", ROUTER_MODULE, *args]

    def _start(self, index: int) -> str:
        """Starts replica ``index``; returns the address once it listens."""
        replica = _Replica(self._command(index))
        if index < len(self.replicas):
            self.replicas[index] = replica
        else:
            self.replicas.append(replica)
        replica.listening.wait(START_SECONDS)
        if not replica.announced:
            raise RuntimeError(
                f"router replica {index} did not listen (exit code {replica.popen.poll()})"
            )
        return self.address

    def _death(self, index: int) -> str | None:
        code = self.replicas[index].popen.poll()
        if code is None or self._closing.is_set():
            return None
        return f"exit code {code}"

    async def start(self) -> None:
        for index in range(self.count):
            await asyncio.to_thread(self._start, index)
        self.supervision = ServerSupervisor(
            self.count,
            death=self._death,
            restart=self._start,
            on_event=lambda line: log.warning("%s", line),
            policy=REPLICA_RESTARTS,
            noun="router replica",
            back_note="new connections reach it again",
            addresses=[f"{self.address} (replica {i})" for i in range(self.count)],
            sleep=self._closing.wait,
        )
        self.supervision.start(self._closing, 0.1, "replica supervisor")
        log.info("%d router replicas listening on %s", self.count, self.address)

    async def wait_ready(self) -> None:
        """Ready once every replica listens (``start``)."""

    async def wait_healthy(self, count: int, timeout: float) -> None:
        """Waits until the replicas (as the shared port answers) see ``count`` healthy
        backends."""
        from skyrl_grpc.channels import open_channel
        from skyrl_grpc.v1 import router_pb2, router_pb2_grpc

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with open_channel(self.address) as channel:
            admin = router_pb2_grpc.RouterAdminStub(channel)
            while True:
                try:
                    listed = await admin.ListBackends(router_pb2.ListBackendsRequest(), timeout=5)
                    healthy = [
                        b for b in listed.backends if b.state == router_pb2.BACKEND_STATE_HEALTHY
                    ]
                    if len(healthy) >= count:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if loop.time() > deadline:
                    raise TimeoutError(f"the router replicas never saw {count} healthy backends")
                await asyncio.sleep(0.1)

    def describe(self) -> dict[str, object]:
        metrics = [r.announced.get("metrics_port") for r in self.replicas]
        return {
            "http_port": self.http_port,
            "metrics_port": metrics[0] if metrics else None,
            "metrics_ports": metrics,
            "replicas": self.count,
        }

    async def stop(self) -> None:
        self._closing.set()
        for replica in self.replicas:
            if replica.popen.poll() is None:
                replica.popen.send_signal(signal.SIGTERM)
        await asyncio.to_thread(self._reap)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _reap(self) -> None:
        for replica in self.replicas:
            try:
                replica.popen.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                replica.popen.kill()
                replica.popen.wait()


async def serve_replicas(args: argparse.Namespace, argv: list[str]) -> None:
    """Runs ``args.replicas`` replicas of the router ``argv`` describes until SIGTERM."""
    replicas = RouterReplicas(
        argv, args.replicas, args.host, args.port, args.http_port, args.metrics_port
    )
    await serve_until_stopped(replicas, replicas.stop, replicas.describe)
