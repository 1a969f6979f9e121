"""Rollouts at the engine's speed: every way to get a batch of samples out of one engine, side
by side in one run (issue #43).

A round is a batch of N prompts (16 tokens each, distinct) generating T tokens each (greedy,
``ignore_eos``), sent all at once, repeated a few times; tokens per second are the batch's
tokens over the wall time, as the trainer waits for them. Contenders, same engine settings:

- ``in-process``      vLLM's ``AsyncLLM`` driven directly in its own process: a ``generate``
                      per prompt, an output per engine step (the limit of any serving layer)
- ``vllm-http``       vLLM's OpenAI server, streaming ``/v1/completions`` (token ids in and
                      out) to aiohttp clients; ``vllm-router`` the Rust router SkyRL runs in
                      front of it
- ``vllm-grpc``       vLLM's own gRPC server (smg-grpc-servicer), a streamed Generate per
                      prompt (where installed)
- ``server ...``      this project's engine server, directly: a GenerateStream per prompt with a
                      message per engine step (``per step``) or per 16 tokens (``16-token``), or
                      the whole batch as one GenerateBatch call (``batched``); ``router ...``
                      the same through the router
- ``client ...``      the trainer client's ``generate_batch`` (sessions, abort retry, results):
                      routing itself, and through the router

Each contender's server processes are frozen (SIGSTOP) while others are measured, so no idle
engine runs beside the one measured; rounds rotate the order. Also reported: the server side's
CPU seconds per 1000 generated tokens, every process serving the request (engine server, its
engine core, the router; vLLM's server and its engine core, vllm-router), read from the OS.

Then the HTTP edge under vLLM's own load generator (``vllm bench serve``: random prompts of
128 tokens, 128 out, 256 prompts at concurrency 64) against vLLM's HTTP server and vllm-router.

Run: .venv/bin/python -m scripts.bench_rollout [--rounds 5] [--samples 64,256]
     [--output docs/performance.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from scripts.bench_common import (
    ProcessTree,
    add_output_argument,
    median_range,
    skyrl_router,
    thaw_all,
    vllm_grpc_available,
    vllm_grpc_server,
    vllm_router,
    write_report,
)
from scripts.bench_edge import BASELINE, SMG, EdgeTarget, edge_section
from scripts.bench_gateways import smg_gateway
from scripts.rollout_clients import (
    InProcess,
    RunBatch,
    grpc_batch,
    grpc_streams,
    http_streams,
    trainer_client,
    vllm_grpc_streams,
)
from servers.engine.options import TINY_MODEL_NAME
from servers.fleet.local import LocalFleet
from skyrl_grpc.process_group import free_port
from testbed.peers import SERVED_NAME, Launched, vllm_http_server


@dataclass
class Contender:
    name: str
    group: Group
    run: RunBatch


@dataclass
class Group:
    """Server processes contenders share; frozen while other groups are measured."""

    name: str
    tree: ProcessTree
    contenders: list[Contender] = field(default_factory=list)

    def add(self, name: str, run: RunBatch) -> None:
        self.contenders.append(Contender(name, self, run))


# -- measuring --------------------------------------------------------------------------------


@dataclass
class Run:
    tokens_per_s: float
    cpu_per_1k: float  # server-side CPU seconds per 1000 generated tokens


async def measure(contender: Contender, samples: int, tokens: int, batches: int) -> Run:
    tree = contender.group.tree
    cpu = tree.cpu_seconds()
    started = time.perf_counter()
    generated = 0
    for batch in range(batches):
        count = await contender.run(samples, tokens, batch)
        if count != samples * tokens:
            raise RuntimeError(f"{contender.name}: {count} tokens, not {samples * tokens}")
        generated += count
    wall = time.perf_counter() - started
    return Run(generated / wall, (tree.cpu_seconds() - cpu) / generated * 1000)


def batches_for(samples: int) -> int:
    """Enough batches for a few seconds of steady state per measurement."""
    return max(1, 512 // samples)


async def rollouts(
    args: argparse.Namespace, groups: list[Group]
) -> dict[int, dict[str, list[Run]]]:
    sizes = [int(s) for s in args.samples.split(",")]
    runs: dict[int, dict[str, list[Run]]] = {n: defaultdict(list) for n in sizes}
    for group in groups:
        group.tree.freeze()
    for group in groups:  # first generations are slow everywhere
        group.tree.thaw()
        for contender in group.contenders:
            await measure(contender, 16, 16, 1)
        group.tree.freeze()
    for round_index in range(args.rounds):
        shift = round_index % len(groups)
        for group in groups[shift:] + groups[:shift]:
            group.tree.thaw()
            for contender in group.contenders:
                for samples in sizes:
                    run = await measure(contender, samples, args.tokens, batches_for(samples))
                    runs[samples][contender.name].append(run)
                    print(
                        f"round {round_index + 1} {samples:>3} {contender.name:<28} "
                        f"{run.tokens_per_s:8.0f} tok/s {run.cpu_per_1k:6.3f} CPU s/1k",
                        flush=True,
                    )
            group.tree.freeze()
    for group in groups:
        group.tree.thaw()
    return runs


def rollout_table(runs: dict[int, dict[str, list[Run]]]) -> list[str]:
    lines = []
    for samples, by_name in runs.items():
        limit = statistics.median(r.tokens_per_s for r in by_name["in-process"])
        http_cpu = statistics.median(r.cpu_per_1k for r in by_name["vllm-http"])
        lines += [
            f"#### {samples} samples at once",
            "",
            "| contender | tokens/s | x in-process | server CPU s / 1k tokens | x vllm-http's |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, results in by_name.items():
            speeds = [r.tokens_per_s for r in results]
            cpus = [r.cpu_per_1k for r in results]
            lines.append(
                f"| {name} | {median_range(speeds, 0)} | {statistics.median(speeds) / limit:.2f} "
                f"| {median_range(cpus, 3)} | {statistics.median(cpus) / http_cpu:.2f} |"
            )
        lines.append("")
    return lines


def ratio(runs: dict[str, list[Run]], name: str, over: str) -> float:
    """The median of the per-round ratios ``name`` / ``over`` (tokens/s)."""
    return statistics.median(
        a.tokens_per_s / b.tokens_per_s for a, b in zip(runs[name], runs[over], strict=True)
    )


def targets_table(runs: dict[int, dict[str, list[Run]]]) -> list[str]:
    lines = [
        "| target | samples | measured (median of per-round ratios) | verdict |",
        "| --- | --- | --- | --- |",
    ]

    def row(
        what: str, samples: int, value: float, goal: float | None, at_most: bool = False
    ) -> None:
        if goal is None:  # shown for comparison, no target of its own
            lines.append(f"| {what} | {samples} | {value:.2f} | - |")
            return
        met = value <= goal if at_most else value >= goal
        sign = "<=" if at_most else ">="
        lines.append(
            f"| {what} {sign} {goal} | {samples} | {value:.2f} | {'met' if met else 'missed'} |"
        )

    for samples, by_name in runs.items():
        row("client batched (routing itself) / in-process", samples,
            ratio(by_name, "client batched, direct", "in-process"), 0.97)  # fmt: skip
        row("client batched (router) / in-process", samples,
            ratio(by_name, "client batched, via router", "in-process"), 0.95)  # fmt: skip
        row("server per step / vllm-http", samples,
            ratio(by_name, "server per step", "vllm-http"), 1.0)  # fmt: skip
        row("router per step / server per step", samples,
            ratio(by_name, "router per step", "server per step"), 0.97)  # fmt: skip
        row("router per step, no multiplex / server per step", samples,
            ratio(by_name, "router per step, no multiplex", "server per step"), None)  # fmt: skip
        cpu = statistics.median(
            a.cpu_per_1k / b.cpu_per_1k
            for a, b in zip(by_name["server batched"], by_name["vllm-http"], strict=True)
        )
        row("server batched CPU / vllm-http CPU", samples, cpu, 0.5, at_most=True)
    return lines


# -- the run ----------------------------------------------------------------------------------


@contextlib.contextmanager
def contenders(
    args: argparse.Namespace,
) -> Iterator[tuple[list[Group], dict[str, EdgeTarget]]]:
    """Every contender's servers, started once; yields the groups and the edge targets."""
    with contextlib.ExitStack() as stack:
        groups: list[Group] = []
        edge_targets: dict[str, EdgeTarget] = {}

        in_process = InProcess()
        stack.callback(in_process.close)
        group = Group("in-process", ProcessTree(in_process.process.pid))
        group.add("in-process", in_process.run)
        groups.append(group)
        group.tree.freeze()

        http: Launched = stack.enter_context(vllm_http_server())
        rust: Launched = stack.enter_context(vllm_router(http.address))
        group = Group("vllm-http", ProcessTree(http.process.pid, rust.process.pid))
        group.add("vllm-http", http_streams(http.address, SERVED_NAME))
        group.add("vllm-router", http_streams(rust.address, SERVED_NAME))
        groups.append(group)
        edge_targets["vllm-http"] = EdgeTarget(group.tree, http.address, SERVED_NAME)
        edge_targets["vllm-router"] = EdgeTarget(
            group.tree, rust.address, SERVED_NAME, ProcessTree(rust.process.pid)
        )
        group.tree.freeze()

        if vllm_grpc_available() and not args.no_vllm_grpc:
            served: Launched = stack.enter_context(vllm_grpc_server())
            group = Group("vllm-grpc", ProcessTree(served.process.pid))
            group.add("vllm-grpc", vllm_grpc_streams(served.address))
            if not args.no_edge:
                # SMG, the Rust gateway, in gRPC mode over vLLM's own gRPC server: it tokenizes,
                # relays and detokenizes, the edge's job.
                gateway, base, model = stack.enter_context(smg_gateway(served.address))
                group.tree.add(gateway.process.pid)
                edge_targets[SMG] = EdgeTarget(
                    group.tree, base, model, ProcessTree(gateway.process.pid)
                )
            groups.append(group)
            group.tree.freeze()

        router_args = ["--http-port", "0", "--event-loop", args.router_loop]
        fleet = stack.enter_context(LocalFleet(1, router_args=router_args))
        router, server = fleet.addresses.router, fleet.addresses.servers[0]
        group = Group("skyrl-grpc", ProcessTree(*fleet.pids))
        group.add("server per step", grpc_streams(server, 0, sessions=False))
        group.add("server 16-token", grpc_streams(server, 16, sessions=False))
        group.add("server batched", grpc_batch(server, 0))
        group.add("router per step", grpc_streams(router, 0, sessions=True))
        group.add("router 16-token", grpc_streams(router, 16, sessions=True))
        group.add("router batched", grpc_batch(router, 0))
        # The same router without multiplexing: each forwarded stream a call of its own.
        plain = stack.enter_context(skyrl_router([server], "--no-multiplex"))
        group.tree.add(plain.process.pid)
        group.add("router per step, no multiplex", grpc_streams(plain.address, 0, sessions=True))
        group.add("client batched, direct", trainer_client(router, [server], direct=True))
        group.add("client batched, via router", trainer_client(router, [server], direct=False))
        # The same edge as two router replicas on one port (``route --replicas 2``).
        replicas_http = free_port("127.0.0.1")
        replicated = stack.enter_context(
            skyrl_router([server], "--replicas", "2", "--http-port", str(replicas_http))
        )
        group.tree.add(replicated.process.pid)
        groups.append(group)
        edge_targets["edge (this router)"] = EdgeTarget(
            group.tree,
            f"http://127.0.0.1:{fleet.http_port}",
            TINY_MODEL_NAME,
            ProcessTree(fleet.pids[-1]),
        )
        edge_targets["edge, 2 replicas"] = EdgeTarget(
            group.tree,
            f"http://127.0.0.1:{replicas_http}",
            TINY_MODEL_NAME,
            ProcessTree(replicated.process.pid),
        )
        if args.edge_baseline:  # another checkout's router, its flags the fleet's router's
            baseline_http = free_port("127.0.0.1")
            flags = list(fleet.router_args)
            at = flags.index("--http-port")
            flags[at + 1] = str(baseline_http)
            baseline = stack.enter_context(
                skyrl_router([server], *flags, source=args.edge_baseline)
            )
            group.tree.add(baseline.process.pid)
            edge_targets[BASELINE] = EdgeTarget(
                group.tree,
                f"http://127.0.0.1:{baseline_http}",
                TINY_MODEL_NAME,
                ProcessTree(baseline.process.pid),
            )
        group.tree.freeze()
        # Thawed before anything is stopped (this runs first): a process stopped while its
        # parent is killed never sees the parent go (a router replica left frozen for good).
        stack.callback(thaw_all, [g.tree for g in groups])
        yield groups, edge_targets


async def main(args: argparse.Namespace) -> None:
    lines: list[str] = []
    if not args.no_rollouts:
        # The rollouts' header names their rounds; an edge-only run (--no-rollouts) has none.
        lines += [
            "### Rollouts: every way to get a batch out of one engine",
            "",
            f"`python -m scripts.bench_rollout --rounds {args.rounds} --samples {args.samples}` "
            f"({args.tokens} tokens a sample, 16-token prompts, greedy; medians of {args.rounds} "
            "interleaved rounds, ranges in brackets; the embedded model, 2 cores).",
            "",
        ]
    with contenders(args) as (groups, edge):
        if not args.no_rollouts:
            runs = await rollouts(args, groups)
            lines += rollout_table(runs)
            lines += ["#### Targets", "", *targets_table(runs), ""]
        if not args.no_edge:
            lines += ["### The HTTP edge under `vllm bench serve`", ""]
            lines += edge_section(args.edge_rounds, edge)
    write_report(args.output, lines, "bench_rollout")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", default="64,256")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--edge-rounds", type=int, default=3)
    parser.add_argument("--no-edge", action="store_true")
    parser.add_argument("--no-rollouts", action="store_true")
    parser.add_argument("--no-vllm-grpc", action="store_true")
    parser.add_argument("--router-loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument(
        "--edge-baseline",
        default="",
        metavar="DIR",
        help="also the edge of a router run from the checkout at DIR (e.g. `git worktree add "
        "DIR HEAD~1`), in front of the same server: a change to the router measured beside it",
    )
    add_output_argument(parser, "performance.md")
    return parser.parse_args()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    asyncio.run(main(parse_args()))
