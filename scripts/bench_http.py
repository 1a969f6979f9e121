"""The OpenAI HTTP edge vs what SkyRL users run, side by side in one run (issue: HTTP edge).

Streaming /v1/completions (token-id prompts, greedy, ``return_token_ids``, an event per
engine step) at 1, 16, 64 and 256 concurrent streams, contenders interleaved round by round:

- ``edge``        this stack: the router process's HTTP edge -> gRPC -> one engine server
- ``vllm-http``   vLLM's own OpenAI server, directly
- ``vllm-router`` the Rust ``vllm-router`` (what SkyRL runs) in front of vLLM's OpenAI server

Both engines use the same settings (scripts/bench_stack.py's). Prints output tokens/s, p50/p99
time to first token and p50 inter-token latency, and the edge / vllm-router ratios.

Run: .venv/bin/python scripts/bench_http.py [--rounds 2] [--output docs/bench-http.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_stack import (  # noqa: E402
    HttpContender,
    Workload,
    compare,
    vllm_http_server,
    write_report,
)

from servers.fleet.local import LocalFleet  # noqa: E402
from tests.helpers.vllm_http import free_port  # noqa: E402


def wait_http(url: str, process: subprocess.Popen[bytes], what: str, log: str) -> None:
    deadline = time.time() + 120
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited; see {log}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2):
                return
        if time.time() > deadline:
            raise TimeoutError(f"{what} did not start; see {log}")
        time.sleep(0.5)


@contextlib.contextmanager
def vllm_router(worker: str) -> Iterator[str]:
    """The Rust vllm-router in front of ``worker``; yields its base URL."""
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    port = free_port()
    command = [
        binary,
        "--worker-urls", worker,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--policy", "round_robin",
        "--log-level", "warning",
        "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-router-", suffix=".log", delete=False)
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process, "vllm-router", log.name)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def named(contender: HttpContender, name: str) -> HttpContender:
    contender.name = name  # type: ignore[misc]
    return contender


async def run(args: argparse.Namespace) -> list[str]:
    rows = [
        "| streams | path | output tok/s | p50 TTFT (ms) | p99 TTFT (ms) | p50 ITL (ms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    ratios = []
    with (
        LocalFleet(
            1, router_args=["--http-port", "0", "--http-stream-interval", str(args.interval)]
        ) as fleet,
        vllm_http_server(stream_interval=args.interval) as direct,
        vllm_router(direct.base_url) as routed,
    ):
        contenders = [
            named(HttpContender(f"http://127.0.0.1:{fleet.http_port}", ""), "edge"),
            named(direct, "vllm-http"),
            named(HttpContender(routed, direct.model), "vllm-router"),
        ]
        for contender in contenders:  # first generations are slow
            await contender.run(Workload(8, 2, 16, 1))
        for concurrency in args.streams:
            per_stream = min(16, max(1, args.requests // concurrency))
            workload = Workload(concurrency, per_stream, args.max_tokens, args.interval)
            summary = await compare(contenders, workload, args.rounds)  # type: ignore[arg-type]
            for path, s in summary.items():
                rows.append(
                    f"| {concurrency} | {path} | {s['tokens_per_s']:.0f} "
                    f"| {s['ttft_p50'] * 1e3:.1f} | {s['ttft_p99'] * 1e3:.1f} "
                    f"| {s['itl_p50'] * 1e3:.2f} |"
                )
            edge, rust = summary["edge"], summary["vllm-router"]
            ratios.append(
                f"- {concurrency} streams: edge / vllm-router output tok/s "
                f"{edge['tokens_per_s'] / rust['tokens_per_s']:.2f}x, p50 TTFT "
                f"{edge['ttft_p50'] * 1e3:.1f} vs {rust['ttft_p50'] * 1e3:.1f} ms; "
                f"edge / vllm-http {edge['tokens_per_s'] / summary['vllm-http']['tokens_per_s']:.2f}x"
            )
            print(rows[-3:], ratios[-1], flush=True)
    return [
        "# OpenAI HTTP edge vs vLLM's server and vllm-router (scripts/bench_http.py)",
        "",
        f"Streaming /v1/completions, {args.max_tokens} tokens per request, greedy, events of "
        f"{args.interval} token(s) (edge: --http-stream-interval, vLLM: --stream-interval); "
        f"median of {args.rounds} interleaved rounds; one engine per path, tiny "
        "model, 2 shared cores.",
        "",
        *rows,
        "",
        *ratios,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256, help="requests per point")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument(
        "--interval", type=int, default=1, help="tokens per event on every path (1: per step)"
    )
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    lines = asyncio.run(run(args))
    if args.output:
        write_report(args.output, lines)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
