"""vLLM's own OpenAI HTTP server on the embedded model, with the engine settings this stack's
engine server uses: the reference for the HTTP edge's compatibility test and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from servers.engine.engine_args import cpu_layout
from servers.engine.options import EngineOptions
from skyrl_grpc.tiny_model import ensure_tiny_model

SERVED_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def vllm_http_server(
    stream_interval: int = 1, model: Path | None = None, extra_args: tuple[str, ...] = ()
) -> Iterator[str]:
    """vLLM's server on ``model`` (default: the embedded one), with ``extra_args`` on its
    command line; yields its base URL."""
    import urllib.request

    options = EngineOptions()
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model or ensure_tiny_model()),
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-num-seqs",
        str(options.max_num_seqs),
        "--seed",
        str(options.seed),
        "--stream-interval",
        str(stream_interval),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--uvicorn-log-level",
        "warning",
        *extra_args,
    ]
    # The CPU layout servers.engine gives the embedded model's engine, as flags and environment.
    layout_args, layout_env = cpu_layout(options)
    for name, value in layout_args.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": f"{options.kv_cache_gib:g}",
        **layout_env,
    }
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-http-", suffix=".log", delete=False)
    process = subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0
    )
    try:
        deadline = time.time() + 600
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM's server exited; see {log.name}: {shlex.join(command)}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            if time.time() > deadline:
                raise TimeoutError(f"vLLM's server did not start; see {log.name}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
