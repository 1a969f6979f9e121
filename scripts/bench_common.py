"""What the benchmarks share: the peers they measure against (vLLM's HTTP server, the Rust
vllm-router, vLLM's gRPC server), process trees measured and frozen from the OS, and reports.

Benchmarks run as modules from the repository root (``python -m scripts.bench_rollout``), so
the project's packages import as they are, with no path set-up of their own.

A contender's processes are a ``ProcessTree``: its CPU seconds are read from the OS
(``psutil``: every process of the tree, children included), and while another contender is
measured it is frozen (SIGSTOP), so no idle engine busy-waits on the cores being measured (an
idle vLLM CPU engine takes about a third of a core).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

from scripts.process_memory import memory_of
from servers.engine.options import EngineOptions
from skyrl_grpc.process_group import free_port
from testbed.peers import (
    Launched,
    launched_process,
    vllm_engine_flags,
    wait_http,
)

ROOT = Path(__file__).resolve().parents[1]


def add_output_argument(parser: argparse.ArgumentParser, page: str) -> None:
    """``--output``: the docs page a script's tables go to (``write_report``)."""
    parser.add_argument(
        "--output",
        default=str(ROOT / "docs" / page),
        help=f"the docs page the run's tables go to, in its measured block (default: docs/"
        f"{page}); '-' prints them only",
    )


def write_report(output: str | Path, lines: Sequence[str], block: str) -> None:
    """Prints a run's markdown report and puts it in the docs page ``output`` ('-': nowhere),
    between the page's ``<!-- {block}: begin -->`` and ``<!-- {block}: end -->`` markers: the
    last run replaces the one before and the page's own prose around it stays. A page without
    that block gets it at its end (a new page is made)."""
    text = "\n".join(lines).strip("\n") + "\n"
    print(text)
    if str(output) == "-":
        return
    path = Path(output)
    begin, end = f"<!-- {block}: begin -->", f"<!-- {block}: end -->"
    measured = f"{begin}\n{text}{end}"
    page = path.read_text() if path.exists() else ""
    if begin in page and end in page:
        before, rest = page.split(begin, 1)
        after = rest.split(end, 1)[1]
        page = before + measured + after
    else:
        page = (page.rstrip("\n") + "\n\n" if page else "") + measured + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def median_range(values: Sequence[float], digits: int = 2) -> str:
    """``median (min-max)``, the way every table here quotes a measured figure."""
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


def tree_processes(pid: int, alone: bool = False) -> list[psutil.Process]:
    """A process and its descendants (``alone``: the process only); none for one gone."""
    try:
        root = psutil.Process(pid)
        return [root] if alone else [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int, alone: bool = False) -> int:
    """Resident bytes of a process and its children (``alone``: of the process alone); a
    process gone meanwhile counts 0."""
    total = 0
    for process in tree_processes(pid, alone):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += process.memory_info().rss
    return total


def tree_pss(pid: int, alone: bool = False) -> int:
    """Proportional resident bytes of a process and its children (Linux: each shared page
    divided among the processes mapping it, so memory the processes share, like a server's
    checkpoint copy that its tensor-parallel ranks all map, counts once); 0 for one gone."""
    total = 0
    for process in tree_processes(pid, alone):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{process.pid}/smaps_rollup") as rollup:
                for line in rollup:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
    return total


def tree_memory(pid: int, alone: bool = False) -> int:
    """``memory_of`` a process and its children (``alone``: the process only)."""
    return memory_of([p.pid for p in tree_processes(pid, alone)])


def tree_fds(pid: int, alone: bool = False) -> int:
    """Open file descriptors of a process and its children, as ``tree_rss`` counts."""
    total = 0
    for process in tree_processes(pid, alone):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += process.num_fds()
    return total


def cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU time of one process so far (its children not counted)."""
    times = process.cpu_times()
    return float(times.user + times.system)


class ProcessTree:
    """Processes (with all their descendants) measured and frozen together."""

    def __init__(self, *pids: int) -> None:
        self.roots = [psutil.Process(pid) for pid in pids]

    def processes(self) -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        for root in self.roots:
            with contextlib.suppress(psutil.NoSuchProcess):
                for process in [root, *root.children(recursive=True)]:
                    found[process.pid] = process
        return list(found.values())

    def add(self, pid: int) -> None:
        self.roots.append(psutil.Process(pid))

    def cpu_seconds(self) -> float:
        """User + system CPU time of every process of the tree so far."""
        total = 0.0
        for process in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                total += cpu_seconds(process)
        return total

    def freeze(self) -> None:
        for process in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.suspend()

    def thaw(self) -> None:
        for process in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.resume()


def thaw_all(trees: Sequence[ProcessTree]) -> None:
    """Every tree in ``trees`` running again (a frozen process never sees its parent go)."""
    for tree in trees:
        tree.thaw()


@contextlib.contextmanager
def vllm_router(worker: str) -> Iterator[Launched]:
    """The Rust vllm-router (what SkyRL runs) in front of ``worker``."""
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    port = free_port("127.0.0.1")
    command = [
        binary,
        "--worker-urls", worker,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--policy", "round_robin",
        "--log-level", "warning",
        "--prometheus-port", str(free_port("127.0.0.1")),
    ]  # fmt: skip
    with launched_process(command, None, "vllm-router") as launched:
        launched.address = f"http://127.0.0.1:{port}"
        wait_http(f"{launched.address}/health", launched, "vllm-router", timeout=120)
        yield launched


def vllm_grpc_available() -> bool:
    """Whether vLLM's gRPC server (the smg-grpc-servicer package) is installed."""
    try:
        import smg_grpc_servicer.vllm.servicer  # noqa: F401
    except ImportError:
        return False
    return True


def _wait_grpc(launched: Launched, what: str, timeout: float = 600) -> None:
    """Until ``launched`` answers SERVING on grpc.health.v1 (service "")."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.time() + timeout
    while True:
        if launched.process.poll() is not None:
            raise RuntimeError(f"{what} exited; see {launched.log}")
        with contextlib.suppress(grpc.RpcError), grpc.insecure_channel(launched.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
            if status.status == health_pb2.HealthCheckResponse.SERVING:
                return
        if time.time() > deadline:
            raise TimeoutError(f"{what} did not start; see {launched.log}")
        time.sleep(1)


@contextlib.contextmanager
def vllm_grpc_server() -> Iterator[Launched]:
    """vLLM's own gRPC server (``vllm serve --grpc``: smg-grpc-servicer) on the embedded
    model, same engine settings."""
    flags, env = vllm_engine_flags(EngineOptions())
    port = free_port("127.0.0.1")
    command = [
        sys.executable, "-m", "vllm.entrypoints.launchers.grpc_server", *flags,
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    # Its stats stay on, vLLM's default, as this project's servers keep them (vllm_http_command).
    with launched_process(command, env, "vllm-grpc") as launched:
        launched.address = f"127.0.0.1:{port}"
        _wait_grpc(launched, "vLLM's gRPC server")
        yield launched


@contextlib.contextmanager
def skyrl_router(backends: list[str], *flags: str, source: str = "") -> Iterator[Launched]:
    """This project's router (``skyrl-grpc route``) in front of ``backends``, with ``flags``;
    run from the checkout at ``source`` where one is given (another commit's router, measured
    beside this one's)."""
    port = free_port("127.0.0.1")
    module = ["-m", "servers.router.router_server"]
    if source:
        module = [
            "-c",
            f"import runpy, sys; sys.path.insert(0, {source!r}); "
            "runpy.run_module('servers.router.router_server', run_name='__main__')",
        ]
    command = [
        sys.executable, *module, "--host", "127.0.0.1",
        "--port", str(port), "--backends", ",".join(backends), *flags,
    ]  # fmt: skip
    with launched_process(command, None, "skyrl-router") as launched:
        launched.address = f"127.0.0.1:{port}"
        _wait_grpc(launched, "the router", timeout=120)
        yield launched


# The receiver's buffer: what one recv can take.
RECEIVE_BYTES = 4 << 20


def raw_tcp(payload_chunks: Sequence[bytes | memoryview]) -> float:
    """Seconds to send every chunk over a loopback TCP socket to a receiver that reads all."""
    total = sum(len(c) for c in payload_chunks)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def receive() -> None:
        connection, _ = listener.accept()
        buffer = bytearray(RECEIVE_BYTES)
        view = memoryview(buffer)
        received = 0
        while received < total:
            n = connection.recv_into(view)
            if not n:
                break
            received += n
        connection.sendall(b"k")
        connection.close()

    thread = threading.Thread(target=receive)
    thread.start()
    sender = socket.create_connection(("127.0.0.1", port))
    started = time.perf_counter()
    for chunk in payload_chunks:
        sender.sendall(chunk)
    sender.recv(1)
    elapsed = time.perf_counter() - started
    sender.close()
    thread.join()
    listener.close()
    return elapsed
