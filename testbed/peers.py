"""The peers this stack is measured and tested against, launched as their users start them:
vLLM's own OpenAI server with this project's engine settings (the benchmarks' contender, the
edge's reference in the tests), and the process helpers every launcher shares (each peer's
log, its process group stopped however the caller ends, a frozen peer thawed first). On a
testbed host, ``vllm_http_command`` is the same server's command line for ``Host.popen``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from servers.common.reaper import EXIT_WITH_SUPERVISOR
from servers.engine.options import EngineOptions
from servers.engine.vllm_adapter.engine_args import cpu_layout, kv_cache_bytes, kv_cache_gib
from skyrl_grpc.process_group import free_port
from skyrl_grpc.tiny_model import ensure_tiny_model

# The model name every contender serves, so one request body fits them all.
SERVED_NAME = "tiny"


@dataclass
class Launched:
    """A peer's process, where it listens, and its log."""

    address: str
    process: subprocess.Popen[bytes]
    log: str


def wait_http(url: str, launched: Launched, what: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while True:
        if launched.process.poll() is not None:
            raise RuntimeError(f"{what} exited; see {launched.log}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2):
                return
        if time.time() > deadline:
            raise TimeoutError(f"{what} did not start; see {launched.log}")
        time.sleep(0.5)


@contextlib.contextmanager
def launched_process(
    command: list[str], env: dict[str, str] | None, what: str
) -> Iterator[Launched]:
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{what}-", suffix=".log", delete=False)
    # This project's servers die with the bench however it dies (their standard input: a pipe
    # only it holds; ``servers.common.reaper.exit_with_supervisor``). Other servers ignore it.
    process = subprocess.Popen(
        command,
        env={**(os.environ if env is None else env), EXIT_WITH_SUPERVISOR: "1"},
        stdin=subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT,
        process_group=0,
    )
    launched = Launched("", process, log.name)
    try:
        yield launched
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGCONT)  # a frozen process cannot stop
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def vllm_engine_flags(
    options: EngineOptions, model: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command-line flags and environment giving vLLM's own servers the engine settings
    this project's engine server uses on ``model`` (default: the embedded model)."""
    flags = [
        "--model", str(model or ensure_tiny_model()),
        "--served-model-name", SERVED_NAME,
        "--dtype", "float32",
        "--enforce-eager",
        "--max-num-seqs", str(options.max_num_seqs),
        "--seed", str(options.seed),
    ]  # fmt: skip
    served = dataclasses.replace(options, model=str(model) if model else options.model)
    flags += ["--kv-cache-memory-bytes", str(kv_cache_bytes(kv_cache_gib(served)))]
    layout_args, layout_env = cpu_layout(options)
    for name, value in layout_args.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    env = {**os.environ, **layout_env}
    return flags, env


@contextlib.contextmanager
def vllm_http_server(
    stream_interval: int = 1, model: Path | None = None, extra_args: Sequence[str] = ()
) -> Iterator[Launched]:
    """vLLM's own OpenAI server on ``model`` (default: the embedded model) with this
    project's engine settings, ``extra_args`` on its command line: the benchmarks' contender
    and the edge's reference in the tests."""
    port = free_port("127.0.0.1")
    command, env = vllm_http_command("127.0.0.1", port, model, stream_interval, extra_args)
    with launched_process(command, env, "vllm-http") as launched:
        launched.address = f"http://127.0.0.1:{port}"
        wait_http(f"{launched.address}/health", launched, "vLLM's HTTP server")
        yield launched


def vllm_http_command(
    host: str,
    port: int,
    model: Path | None = None,
    stream_interval: int = 1,
    extra_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI server's command line on ``host:port`` and its environment."""
    flags, env = vllm_engine_flags(EngineOptions(), model)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags,
        "--stream-interval", str(stream_interval),
        "--host", host, "--port", str(port),
        "--uvicorn-log-level", "warning", *extra_args,
    ]  # fmt: skip
    # vLLM's stats stay on, its default: this project's servers always keep them (their load
    # reports and vllm:* metrics come from them), so both do the same bookkeeping per step.
    return command, env
