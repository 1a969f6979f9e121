"""Where the per-step path spends its CPU: py-spy on the engine server and the router while 64
streams (a message per engine step) run through the router.

Starts a local fleet of one server and its router, keeps rounds of 64 GenerateStream calls of
128 tokens (``bench_rollout``'s per-step router contender) running for ``--seconds``, samples
both processes with py-spy (``--nonblocking``, native frames off), and prints the functions
with the most samples of their own (self time) and the share of samples under each top-level
group: grpc's Cython callbacks, protobuf, vLLM's output processing, this project's code.
``--no-multiplex`` starts the router with plain forwarding; ``--edge`` profiles the OpenAI edge
under ``vllm bench serve`` instead (what ``bench_edge`` measures); ``--rollouts`` the trainer
client's ``generate_batch`` through the router (what ``bench_observability`` measures);
``--traces`` turns on OpenTelemetry on both processes (spans to a receiver in this process),
``--metrics`` serves every /metrics page and scrapes them each second; either way the report
gives the share of samples spent under tracing and under metrics code (any of its frames on
the stack) and where each is entered.

Run: .venv/bin/python -m scripts.profile_per_step [--seconds 20] [--no-multiplex | --edge |
--rollouts] [--traces] [--metrics]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from scripts.bench_common import ROOT
from scripts.bench_edge import bench_serve
from scripts.bench_observability import Scraper
from scripts.otlp_sink import OtlpSink
from scripts.rollout_clients import RunBatch, grpc_streams, trainer_client
from servers.engine.options import TINY_MODEL_NAME
from servers.fleet.local import LocalFleet

GROUPS = (
    ("opentelemetry", ("opentelemetry/",)),
    ("grpc (Cython callbacks, channel, server)", ("grpc/_cython", "grpc/aio", "grpc/_")),
    ("protobuf", ("google/protobuf",)),
    ("vLLM", ("vllm/",)),
    ("asyncio", ("asyncio/",)),
    ("this project", ("servers/", "skyrl_grpc/", "trainer_client/")),
)


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(found):
        raise SystemExit("py-spy is not installed: pip install py-spy (the dev extra has it)")
    return found


def edge_load(base_url: str, seconds: float) -> int:
    """``vllm bench serve`` against the HTTP edge (``bench_edge``'s load: 256 prompts of 128
    random tokens, 128 out, concurrency 64), run after run until ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    tokens, round_ = 0, 0
    with tempfile.TemporaryDirectory() as directory:
        while time.monotonic() < deadline:
            figures = bench_serve(base_url, TINY_MODEL_NAME, Path(directory), f"profile-{round_}")
            tokens += int(figures["tokens"])
            round_ += 1
    return tokens


async def until(make_run: Callable[[], RunBatch], seconds: float) -> int:
    """Rounds of 64 samples of 128 tokens through the client ``make_run`` makes (in this event
    loop, where its channels live) until ``seconds`` have passed; the tokens generated."""
    run = make_run()
    deadline = time.monotonic() + seconds
    tokens, round_ = 0, 0
    while time.monotonic() < deadline:
        tokens += await run(64, 128, round_)
        round_ += 1
    return tokens


# Inclusive shares: the samples with any frame of these on the stack, and where they are entered.
SHARES = (
    ("tracing", ("opentelemetry/", "skyrl_grpc/tracing.py")),
    (
        "metrics",
        (
            "prometheus_client/",
            "vllm/v1/metrics/",
            "servers/common/grpc_metrics.py",
            "servers/engine/process/server_metrics.py",
            "servers/router/metrics.py",
            "servers/router/loop_series.py",
        ),
    ),
)


def summarize(raw: Path, top: int) -> list[str]:
    """py-spy's raw (collapsed) stacks: the top functions by self samples, and the groups."""
    own: collections.Counter[str] = collections.Counter()
    groups: collections.Counter[str] = collections.Counter()
    # Per share: its samples, and them by the share's first frame on the stack.
    under: dict[str, collections.Counter[str]] = {name: collections.Counter() for name, _ in SHARES}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        for name, marks in SHARES:
            first = next((frame for frame in frames if any(m in frame for m in marks)), None)
            if first is not None:
                under[name][first] += count
        own[frames[-1]] += count
        leaf = frames[-1]
        group = next(
            (name for name, marks in GROUPS if any(mark in leaf for mark in marks)), "other"
        )
        groups[group] += count
    if not total:
        return ["(no samples)"]
    lines = ["| self samples | function |", "| --- | --- |"]
    for frame, count in own.most_common(top):
        lines.append(f"| {100 * count / total:.1f}% | `{frame}` |")
    lines += ["", "| group (by the innermost Python frame) | share |", "| --- | --- |"]
    for name, count in groups.most_common():
        lines.append(f"| {name} | {100 * count / total:.1f}% |")
    for name, entered in under.items():
        share = 100 * sum(entered.values()) / total
        lines.append(f"\nUnder {name} (inclusive): {share:.1f}% of samples.")
        for frame, count in entered.most_common(5):
            lines.append(f"- {100 * count / total:.1f}% entering at `{frame}`")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--no-multiplex", action="store_true")
    parser.add_argument(
        "--edge", action="store_true", help="the OpenAI edge under vllm bench serve instead"
    )
    parser.add_argument(
        "--rollouts", action="store_true", help="trainer-client batches via the router instead"
    )
    parser.add_argument("--traces", action="store_true", help="OpenTelemetry on, spans kept here")
    parser.add_argument(
        "--metrics", action="store_true", help="every /metrics port served and scraped each second"
    )
    args = parser.parse_args()
    spy = py_spy()
    router_args = ["--no-multiplex"] if args.no_multiplex else []
    router_args += ["--http-port", "0"] if args.edge else []
    engine_args: list[str] = []
    sink = OtlpSink() if args.traces else None
    if sink is not None:
        engine_args = ["--otlp-traces-endpoint", sink.endpoint]
        router_args += engine_args
    router_args += ["--metrics-port", "0"] if args.metrics else []
    fleet = LocalFleet(
        1, engine_args=engine_args, router_args=router_args, server_metrics=args.metrics
    )
    with fleet, tempfile.TemporaryDirectory() as tmp:
        router, server = fleet.addresses.router, fleet.addresses.servers[0]
        edge = f"http://{router.rpartition(':')[0]}:{fleet.http_port}"

        def run_load(seconds: float) -> int:
            if args.edge:
                return edge_load(edge, seconds)
            if args.rollouts:  # trainer-client batches via the router (bench_observability's)
                return asyncio.run(
                    until(lambda: trainer_client(router, [server], direct=False), seconds)
                )
            # 64 concurrent per-step streams (bench_rollout's router contender: sessions, a
            # message per engine step)
            return asyncio.run(until(lambda: grpc_streams(router, 0, sessions=True), seconds))

        scraper = None
        if args.metrics:  # as Prometheus would: both pages every second
            while not all(fleet.server_metrics_ports):
                time.sleep(0.1)
            host = router.rpartition(":")[0]
            scraper = Scraper(
                [
                    f"http://{host}:{fleet.server_metrics_ports[0]}/metrics",
                    f"http://{host}:{fleet.metrics_port}/metrics",
                ]
            )
            scraper.running(True)
        run_load(5)  # warm: compiled paths, the prefix cache, the mux call
        pids = dict(zip(("router", "server"), fleet.pids[-1:] + fleet.pids[:1], strict=True))
        recorders = {}
        for name, pid in pids.items():
            out = Path(tmp) / f"{name}.txt"
            recorders[name] = (
                out,
                subprocess.Popen(
                    [spy, "record", "--pid", str(pid), "--format", "raw", "--nonblocking",
                     "--rate", "200", "--duration", str(int(args.seconds)), "--output", str(out)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                ),
            )  # fmt: skip
        began = time.monotonic()
        tokens = run_load(args.seconds)
        elapsed = time.monotonic() - began
        for _, recorder in recorders.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                recorder.wait(timeout=60)
        if scraper is not None:
            scraper.close()
        mode = "plain forwarding" if args.no_multiplex else "multiplexed"
        traced = (", traces on" if sink is not None else "") + (
            ", metrics served and scraped" if scraper is not None else ""
        )
        if args.edge:
            print(f"# the OpenAI edge under vllm bench serve (concurrency 64; {mode}{traced})")
        elif args.rollouts:
            print(f"# trainer-client batches of 64 x 128 tokens via the router ({mode}{traced})")
        else:
            print(f"# per-step path, 64 streams x 128 tokens through the router ({mode}{traced})")
        print(f"\n{tokens / elapsed:.0f} tokens/s while profiled (py-spy slows what it samples)")
        for name, (out, _) in recorders.items():
            print(f"\n## {name} ({server if name == 'server' else router})\n")
            print("\n".join(summarize(out, args.top)))
    if sink is not None:
        print(f"\nSpans received: {sink.counter.spans}.")
        sink.stop()


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
