"""SMG, the Rust gateway, in front of a fleet (``skyrl-grpc up --gateway smg``): launched over
the fleet's serving servers (vLLM's ``VllmEngine`` protocol, which every engine server also
serves) and kept current as the fleet changes: a server added (``scale``) or moved to a new
address is added to SMG's workers (``POST /workers``), one removed or become a standby is
taken out (``DELETE /workers/{id}``). A server restarted on its own address stays listed; SMG's
health checks take it out while it is down and back once it serves.

Sessions stay on one server by this stack's header (SMG's sticky sessions keyed by
``x-session-id``), as through the router."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import httpx

from servers.fleet import Fleet
from skyrl_grpc.metadata import SESSION_ID
from skyrl_grpc.process_group import free_port

SMG_EXECUTABLE = Path(sys.executable).with_name("smg")
# Seconds to wait for SMG to list the model and every worker (it loads the tokenizer from the
# first server it reaches).
START_SECONDS = 120.0
# Seconds between two looks at the fleet's membership.
SYNC_INTERVAL = 1.0


# Server flags SMG cannot go with: it would need the servers' data token or CA, which this
# stack does not hand it.
UNREACHABLE_WITH = ("--data-token", "--tls-cert", "--tls-client-ca")
# Linux's prctl(PR_SET_PDEATHSIG): SMG is sent SIGTERM when ``up`` dies, however it dies (the
# engine servers end themselves then too). Looked up before any fork: the child only calls it.
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def worker_url(address: str) -> str:
    return f"grpc://{address}"


def add_gateway_arguments(up: argparse.ArgumentParser) -> None:
    """``up``'s gateway flags."""
    up.add_argument(
        "--gateway",
        choices=["smg"],
        default=None,
        help="also start this gateway in front of the servers, kept current as the fleet "
        "changes (smg: SMG, the Rust gateway, over vLLM's gRPC protocol; default: none)",
    )
    up.add_argument(
        "--gateway-port",
        type=int,
        default=30000,
        help="the gateway's OpenAI HTTP port on the router's host (0: any free port)",
    )
    up.add_argument(
        "--gateway-args",
        default="",
        help="more of the gateway's own flags, as one string, e.g. "
        "--gateway-args='--tool-call-parser qwen' (needs --gateway)",
    )


def refuse_unreachable(
    gateway: str | None, server_args: Sequence[str], gateway_args: str = ""
) -> None:
    """One line, before anything starts, where the gateway cannot reach the servers (or is
    given flags without being asked for)."""
    if gateway_args and not gateway:
        raise SystemExit("skyrl-grpc up: --gateway-args needs --gateway smg")
    used = [f for f in UNREACHABLE_WITH if any(a.split("=")[0] == f for a in server_args)]
    if gateway and used:
        raise SystemExit(
            f"skyrl-grpc up: --gateway {gateway} cannot call servers started with "
            f"{', '.join(used)} (SMG is given neither the data token nor the CA); use the "
            "router's OpenAI edge (--http-port) instead"
        )


def serving(fleet: Fleet) -> list[str]:
    """The fleet's servers that take calls now (its standbys left out)."""
    return [s for s in fleet.addresses.servers if s not in fleet.addresses.standbys]


def launch_for(
    fleet: Fleet, host: str, port: int, log_dir: Path | None, extra_args: Sequence[str] = ()
) -> SmgGateway:
    """SMG over ``fleet``'s serving servers on ``host:port`` (0: any free port), kept current
    as the fleet changes; ``extra_args``: more of SMG's flags."""
    gateway = SmgGateway(
        host, port or free_port(host), log_dir=log_dir, on_event=fleet.on_event,
        extra_args=extra_args,
    )  # fmt: skip
    try:
        gateway.start(serving(fleet))
    except BaseException:
        gateway.close()
        raise
    gateway.keep_current(lambda: serving(fleet))
    return gateway


class SmgGateway:
    """One ``smg launch`` process over the servers ``start`` is given, on ``host:port``, its
    Prometheus metrics on ``host:metrics_port`` (a free port: SMG's default, 29000 on every
    interface, would keep a second gateway on the host from starting); ``sync`` makes its
    workers the servers it is given. ``close`` stops it."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        log_dir: Path | None = None,
        on_event: Callable[[str], None] = print,
        executable: Path = SMG_EXECUTABLE,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.host, self.port = host, port
        self.metrics_port = free_port(host)
        self.extra_args = list(extra_args)
        self.base = f"http://{host}:{port}"
        self.log_dir = log_dir
        self.on_event = on_event
        self.executable = executable
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[str] | None = None
        self._http = httpx.Client(base_url=self.base, timeout=10)
        self._closing = threading.Event()
        self._keeper: threading.Thread | None = None

    def start(self, servers: Sequence[str], timeout: float = START_SECONDS) -> None:
        """Launches SMG over ``servers`` and returns once it lists the model and each of them;
        raises RuntimeError naming its log if it exits or does not within ``timeout``."""
        if not self.executable.exists():
            raise RuntimeError(f"{self.executable} not found (pip install smg)")
        command = [str(self.executable), "launch", "--host", self.host, "--port", str(self.port)]
        command += ["--worker-urls", *(worker_url(s) for s in servers)]
        command += ["--sticky-sessions", "--routing-key-headers", SESSION_ID]
        # A dead server out of rotation within ~2 s and back at its first answer (SMG's
        # defaults: a look a minute, three misses), and kept listed while down: membership is
        # this fleet's to say (``sync``), not SMG's to forget.
        command += ["--health-check-interval-secs", "1", "--health-failure-threshold", "2"]
        command += ["--health-success-threshold", "1", "--no-remove-unhealthy-workers"]
        command += ["--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port)]
        command += ["--log-level", "warn", *self.extra_args]
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_dir / "smg.log", "a+")  # closed with the gateway
        else:  # kept only to say why, should it fail to start
            self._log = tempfile.TemporaryFile("w+")
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            process_group=0,  # its own group: stopped as one, whatever it starts
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while not self._lists(servers):
            if self._process.poll() is not None:
                raise RuntimeError(f"smg exited {self._process.returncode}{self._see_log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"smg did not list the servers in {timeout:.0f}s{self._see_log()}"
                )
            time.sleep(0.2)

    def _see_log(self) -> str:
        """Its output's last lines, and where the rest is."""
        assert self._log is not None
        self._log.flush()
        self._log.seek(0)
        tail = " | ".join(line.strip() for line in self._log.read().splitlines()[-3:])
        where = f"; see {self.log_dir / 'smg.log'}" if self.log_dir is not None else ""
        return f": {tail or 'no output'}{where}"

    def _lists(self, servers: Sequence[str]) -> bool:
        try:
            models = self._http.get("/v1/models").json().get("data", [])
            return bool(models) and set(self.workers()) == {worker_url(s) for s in servers}
        except (httpx.HTTPError, ValueError):
            return False

    def workers(self) -> dict[str, str]:
        """SMG's workers now: url -> SMG's id of it."""
        answer = self._http.get("/workers")
        answer.raise_for_status()
        listed: Any = answer.json()
        if isinstance(listed, dict):
            listed = listed.get("workers", [])
        return {w["url"]: str(w.get("id", w["url"])) for w in listed}

    def sync(self, servers: Sequence[str]) -> None:
        """Adds the servers SMG lacks and removes the workers not among ``servers``."""
        wanted = {worker_url(s) for s in servers}
        listed = self.workers()
        for url in sorted(wanted - set(listed)):
            answer = self._http.post("/workers", json={"url": url})
            if answer.status_code >= 300:
                raise RuntimeError(f"smg refused worker {url}: {answer.status_code} {answer.text}")
            self.on_event(f"smg: added worker {url}")
        for url in sorted(set(listed) - wanted):
            answer = self._http.delete(f"/workers/{listed[url]}")
            if answer.status_code >= 300 and answer.status_code != 404:
                raise RuntimeError(f"smg kept worker {url}: {answer.status_code} {answer.text}")
            self.on_event(f"smg: removed worker {url}")

    def keep_current(self, serving: Callable[[], Sequence[str]]) -> None:
        """Calls ``sync(serving())`` every ``SYNC_INTERVAL`` seconds in a thread, until
        ``close``; a failed sync is reported and tried again at the next look."""

        def keep() -> None:
            last: tuple[str, ...] = ()
            while not self._closing.wait(SYNC_INTERVAL):
                now = tuple(serving())
                if now == last:
                    continue
                try:
                    self.sync(now)
                    last = now
                except (httpx.HTTPError, RuntimeError) as error:
                    self.on_event(f"smg: could not update its workers ({error}); trying again")

        self._keeper = threading.Thread(target=keep, name="smg-workers", daemon=True)
        self._keeper.start()

    def close(self) -> None:
        self._closing.set()
        if self._keeper is not None:
            self._keeper.join(timeout=SYNC_INTERVAL + 15)
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self._http.close()
        if self._log is not None:
            self._log.close()
