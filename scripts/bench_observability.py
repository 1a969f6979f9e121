"""What watching the fleet costs it: the same one-server stack with metrics and tracing off and
on, rounds interleaved (issue 71's target: throughput within 3%; a scrape under load answers in
under 100 ms).

Three local fleets of one engine server and a router each, each frozen while another runs:
"off" (no /metrics, no traces), "metrics" (every /metrics port served, both pages scraped every
second as Prometheus would, each scrape timed) and "metrics + traces" (the same, and
--otlp-traces-endpoint on the servers and the router, the spans received by an OTLP receiver
in this process). Each round runs,
on each fleet, rollouts through the trainer client (``generate_batch`` via the router: 64
samples of 128 tokens, 8 batches) and ``vllm bench serve`` against the HTTP edge
(``bench_edge``). Besides throughput (which this shared 2-core machine moves by +-10% round to
round) it reports what the work costs: CPU seconds per 1000 output tokens of the whole stack
(server, vLLM's engine core, router) and of the router alone, which move far less.

Run: .venv/bin/python -m scripts.bench_observability [--rounds 3] [--output docs/observability.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from scripts.bench_common import (
    ProcessTree,
    add_output_argument,
    median_range,
    thaw_all,
    write_report,
)
from scripts.bench_edge import bench_serve
from scripts.otlp_sink import OtlpSink
from scripts.rollout_clients import trainer_client
from servers.engine.options import TINY_MODEL_NAME
from servers.fleet.local import LocalFleet

SAMPLES, TOKENS, BATCHES = 64, 128, 8


class Scraper:
    """Scrapes ``pages`` every second on a thread of its own while on; keeps each scrape's
    seconds."""

    def __init__(self, pages: list[str]) -> None:
        self.pages = pages
        self.seconds: list[float] = []
        self._on = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._on.wait(0.2):
                for page in self.pages:
                    started = time.perf_counter()
                    urllib.request.urlopen(page, timeout=10).read()
                    self.seconds.append(time.perf_counter() - started)
                self._stop.wait(1.0)

    def running(self, on: bool) -> None:
        (self._on.set if on else self._on.clear)()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)


async def rollout(router: str, server: str) -> tuple[int, float]:
    """Tokens and seconds of ``BATCHES`` trainer-client batches via the router."""
    run = trainer_client(router, [server], direct=False)
    started = time.perf_counter()
    tokens = 0
    for batch in range(BATCHES):
        tokens += await run(SAMPLES, TOKENS, batch)
    return tokens, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    add_output_argument(parser, "observability.md")
    args = parser.parse_args()

    sink = OtlpSink()
    traced = ["--otlp-traces-endpoint", sink.endpoint]
    names = ["off", "metrics", "metrics + traces"]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with contextlib.ExitStack() as stack:
        fleets = {
            "off": LocalFleet(1, router_args=["--http-port", "0"]),
            "metrics": LocalFleet(
                1, router_args=["--http-port", "0", "--metrics-port", "0"], server_metrics=True
            ),
            "metrics + traces": LocalFleet(
                1,
                engine_args=traced,
                router_args=["--http-port", "0", "--metrics-port", "0", *traced],
                server_metrics=True,
            ),
        }
        for fleet in fleets.values():
            stack.enter_context(fleet)
        directory = stack.enter_context(tempfile.TemporaryDirectory())
        host = fleets["off"].addresses.router.rpartition(":")[0]
        scrapers: dict[str, Scraper] = {}
        for name in names[1:]:
            watched = fleets[name]
            while not all(watched.server_metrics_ports):
                time.sleep(0.1)
            scrapers[name] = Scraper(
                [
                    f"http://{host}:{watched.server_metrics_ports[0]}/metrics",
                    f"http://{host}:{watched.metrics_port}/metrics",
                ]
            )
        trees = {name: ProcessTree(*fleet.pids) for name, fleet in fleets.items()}
        routers = {name: ProcessTree(fleet.pids[-1]) for name, fleet in fleets.items()}
        # Thawed before the fleets stop, however the rounds end (a frozen process never sees
        # its parent go).
        stack.callback(thaw_all, list(trees.values()))
        for tree in trees.values():
            tree.freeze()
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                fleet = fleets[name]
                trees[name].thaw()
                scraper = scrapers.get(name)
                if scraper is not None:
                    scraper.running(True)
                try:
                    router, server = fleet.addresses.router, fleet.addresses.servers[0]
                    if round_index == 0:  # first generations are slow everywhere
                        asyncio.run(rollout(router, server))
                    stack_cpu = trees[name].cpu_seconds()
                    tokens, seconds = asyncio.run(rollout(router, server))
                    figures = {
                        "rollout_tok_s": tokens / seconds,
                        "rollout_cpu_1k": 1000 * (trees[name].cpu_seconds() - stack_cpu) / tokens,
                    }
                    stack_cpu, router_cpu = trees[name].cpu_seconds(), routers[name].cpu_seconds()
                    edge = bench_serve(
                        f"http://{host}:{fleet.http_port}",
                        TINY_MODEL_NAME,
                        Path(directory),
                        f"{round_index}-{name.replace(' ', '')}",
                    )
                    edge_tokens = edge.pop("tokens")
                    figures["edge_cpu_1k"] = (
                        1000 * (trees[name].cpu_seconds() - stack_cpu) / edge_tokens
                    )
                    figures["edge_router_cpu_1k"] = (
                        1000 * (routers[name].cpu_seconds() - router_cpu) / edge_tokens
                    )
                finally:
                    if scraper is not None:
                        scraper.running(False)
                    trees[name].freeze()
                results[name].append({**figures, **edge})
                print(f"round {round_index + 1} {name}: {results[name][-1]}", flush=True)
        for tree in trees.values():
            tree.thaw()
        for scraper in scrapers.values():
            scraper.close()
    sink.stop()

    keys = ["rollout_tok_s", "output_tok_s", "p99_ttft_ms", "p99_itl_ms"]
    lines = [
        "`python -m scripts.bench_observability "
        f"--rounds {args.rounds}` (one server and its router per configuration, the embedded model, "
        f"2 cores; rollouts: {BATCHES} trainer-client batches of {SAMPLES} x {TOKENS} tokens via "
        "the router; edge: `vllm bench serve` as in bench_edge; medians, ranges in brackets).",
        "",
        "| observability | rollout tok/s | edge output tok/s | edge p99 TTFT (ms) "
        "| edge p99 ITL (ms) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, runs in results.items():
        cells = [median_range([r[k] for r in runs], 1) for k in keys]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    cpu_keys = ["rollout_cpu_1k", "edge_cpu_1k", "edge_router_cpu_1k"]
    lines += [
        "",
        "CPU seconds per 1000 output tokens (user + system, every process of the stack: the "
        "server, vLLM's engine core, the router; and the router alone at the edge):",
        "",
        "| observability | rollouts, stack | edge, stack | edge, router |",
        "| --- | --- | --- | --- |",
    ]
    for name, runs in results.items():
        cells = [median_range([r[k] for r in runs], 3) for k in cpu_keys]
        lines.append(f"| {name} | {' | '.join(cells)} |")

    def ratio(name: str, key: str) -> float:
        return statistics.median(
            b[key] / a[key] for a, b in zip(results["off"], results[name], strict=True)
        )

    lines += ["", "Against off (median of per-round ratios; target: within 3%):", ""]
    for name in names[1:]:
        scrapes = sorted(scrapers[name].seconds)
        p99 = scrapes[min(len(scrapes) - 1, int(0.99 * len(scrapes)))]
        lines.append(
            f"- {name}: rollout tokens/s {ratio(name, 'rollout_tok_s'):.3f}, edge output "
            f"tokens/s {ratio(name, 'output_tok_s'):.3f}; CPU per token: rollouts "
            f"{ratio(name, 'rollout_cpu_1k'):.3f}, edge {ratio(name, 'edge_cpu_1k'):.3f} "
            f"(router {ratio(name, 'edge_router_cpu_1k'):.3f}); {len(scrapes)} scrapes under "
            f"load, p99 {1000 * p99:.1f} ms, max {1000 * scrapes[-1]:.1f} ms (target < 100 ms)"
        )
    lines.append(f"\nSpans received: {sink.counter.spans}.")
    write_report(args.output, lines, "observability-overhead")


if __name__ == "__main__":
    main()
