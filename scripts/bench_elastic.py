"""A fleet grown 2 -> 4 -> 2 through FleetAdmin while an RL loop trains on it.

A local fleet on the embedded model (supervised, FleetAdmin served as `up --admin-port`
serves it) and a training loop: each step generates ``--sessions`` session rollouts of
``--tokens`` tokens (the client routing itself), pauses the fleet, pushes a delta weight update
as the step's version, and resumes; a step whose pause or update fails is tried again after
0.5 s, as a trainer would. After step ``--grow-at`` a FleetAdminClient scales the fleet to
``--to`` servers (in a thread: the loop goes on), and ``--hold`` steps after that call returned,
back to ``--servers``.

Reported: each Scale's duration, where the added servers stood when it returned (their weight
version against the fleet's, as the router lists them), generations lost (a call that raised,
or a sample cut short), updates tried again, and step times by phase (before, while growing,
grown, while shrinking, after).

Run: .venv/bin/python -m scripts.bench_elastic [--output docs/fleet.md | -]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from safetensors.torch import load_file

from scripts.bench_common import add_output_argument, write_report
from scripts.rl_steps import Tally, finish_step, start_rollout
from servers.fleet.admin import FleetScaler, serve
from servers.fleet.local import LocalFleet
from skyrl_grpc.tiny_model import ensure_tiny_model
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from trainer_client import FleetAdminClient, InferenceClient


@dataclass
class Run(Tally):
    steps: list[tuple[str, float]] = field(default_factory=list)  # (phase, seconds)
    scales: list[tuple[int, float, str]] = field(default_factory=list)  # (to, seconds, where)


async def standing(router: str, added: set[str]) -> str:
    """The added servers' weight versions (asked of each) against the newest the router lists
    (its listing says 0 for a server whose status it has not heard yet)."""
    async with grpc.aio.insecure_channel(router) as channel:
        listed = await router_pb2_grpc.RouterAdminStub(channel).ListBackends(
            router_pb2.ListBackendsRequest(), timeout=10
        )
    newest = max(b.weight_version for b in listed.backends)
    versions = []
    for address in sorted(added):
        client = InferenceClient(address, [address], direct=False)
        try:
            versions += list((await client.weight_versions()).values())
        finally:
            await client.close()
    return f"added at versions {sorted(versions)}, the fleet at {newest}"


async def training(fleet: LocalFleet, admin: str, run: Run, args: argparse.Namespace) -> None:
    import torch

    client = InferenceClient(fleet.addresses.router, fleet.addresses.servers, control_timeout=120)
    weights = load_file(str(ensure_tiny_model() / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    rng = random.Random(7)
    scaling: asyncio.Task[None] | None = None
    phase, grown_at = "2 servers", None

    async def scale(to: int, next_phase: str) -> None:
        nonlocal phase
        before = set(fleet.addresses.servers)
        started = time.monotonic()
        with FleetAdminClient(admin) as fleet_admin:
            members = await asyncio.to_thread(fleet_admin.scale, to, 900.0)
        seconds = time.monotonic() - started
        added = set(members.servers) - before
        where = await standing(members.router, added) if added else "drained and stopped"
        run.scales.append((to, seconds, where))
        phase = next_phase

    back_at: int | None = None
    for step in range(args.max_steps):
        if scaling is not None and scaling.done():
            scaling.result()  # a failed Scale ends the run, with its error
        if step == args.grow_at:
            phase = "growing"
            scaling = asyncio.ensure_future(scale(args.to, f"{args.to} servers"))
        if phase == f"{args.to} servers":
            grown_at = step if grown_at is None else grown_at
            if step >= grown_at + args.hold:
                phase = "shrinking"
                scaling = asyncio.ensure_future(scale(args.servers, f"{args.servers} again"))
        if phase == f"{args.servers} again":
            back_at = step if back_at is None else back_at
            if step >= back_at + args.hold:
                break
        started = time.monotonic()
        step_phase = phase
        batch = start_rollout(client, rng, args.sessions, args.tokens, "elastic")
        await finish_step(client, batch, weights, generator, step, args.sessions, args.tokens, run)
        run.steps.append((step_phase, time.monotonic() - started))
    if scaling is not None:
        await scaling
    await client.close()


def report(run: Run, args: argparse.Namespace) -> list[str]:
    lines = [
        f"### {args.servers} -> {args.to} -> {args.servers} servers under an RL loop",
        "",
        f"The embedded model, this 2-core VM; each step {args.sessions} session rollouts of "
        f"{args.tokens} tokens, pause, a delta update, resume; FleetAdmin Scale to {args.to} "
        f"after step {args.grow_at}, back to {args.servers} {args.hold} steps after it returned.",
        "",
        "| Scale to | took (s) | when it returned |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {to} | {seconds:.1f} | {where} |" for to, seconds, where in run.scales]
    lines += ["", "| phase | steps | step (s), median | worst |", "| --- | --- | --- | --- |"]
    phases: dict[str, list[float]] = {}
    for phase, seconds in run.steps:
        phases.setdefault(phase, []).append(seconds)
    for phase, times in phases.items():
        lines.append(
            f"| {phase} | {len(times)} | {statistics.median(times):.2f} | {max(times):.2f} |"
        )
    lines += [
        "",
        f"Generations lost: {run.lost} of {len(run.steps) * args.sessions}; updates tried "
        f"again: {run.retries}.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--to", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=1000, help="a bound on the run")
    parser.add_argument("--grow-at", type=int, default=4)
    parser.add_argument("--hold", type=int, default=5, help="steps at each size reached")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    add_output_argument(parser, "fleet.md")
    args = parser.parse_args()
    run = Run()
    logs = Path(tempfile.mkdtemp(prefix="elastic-bench-"))
    with LocalFleet(args.servers, on_event=run.events.append, log_dir=logs) as fleet:
        fleet.supervise()
        scaler = FleetScaler(fleet.scale, lambda: fleet.addresses)
        server, port = serve(scaler, "127.0.0.1", 0)
        try:
            asyncio.run(training(fleet, f"127.0.0.1:{port}", run, args))
        finally:
            server.stop(grace=None)
    print("\n".join(run.events[-20:]), f"\nlogs: {logs}", flush=True)
    write_report(args.output, report(run, args), "elastic_bench")


if __name__ == "__main__":
    main()
