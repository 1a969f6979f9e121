"""kill -9 of a serving server under an RL loop, with a warm standby and without, side by side.

Each mode runs a local fleet on the embedded model (``--servers`` serving servers, plus one
standby in the standby mode; supervised) and a training loop on it: each step generates
``--sessions`` session rollouts of ``--tokens`` tokens (the client routing itself), pauses
the fleet, pushes a delta weight update as the step's version, and resumes; a step whose pause
or update fails (a server down) is tried again after 0.5 s, as a trainer would. During step
``--kill-at`` (mid-rollout, once its generations run), server 0 is killed with SIGKILL.

Reported per mode: the time from the kill until the fleet is at full capacity at its version
(``--servers`` members healthy, serving, on the newest version, as the router lists them,
polled every 50 ms), generations lost (a call that raised, or a sample cut short), step times
(median of the steps before the kill, the step of the kill, the worst after it), updates
tried again, and in the standby mode the idle standby's memory (USS of its process tree)
beside a serving server's.

Run: .venv/bin/python -m scripts.bench_standby [--output docs/fleet.md | -]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import grpc
from safetensors.torch import load_file

from scripts.bench_common import add_output_argument, write_report
from scripts.bench_server_memory import settle
from scripts.rl_steps import Tally, finish_step, start_rollout
from servers.fleet.local import LocalFleet
from skyrl_grpc.tiny_model import ensure_tiny_model
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from trainer_client import InferenceClient

GB = 1e9


@dataclass
class Mode(Tally):
    standby: int = 0
    step_seconds: list[float] = field(default_factory=list)
    kill_step: int = 0
    full_after: float | None = None  # seconds from the kill to full capacity at the version
    memory: dict[str, float] = field(default_factory=dict)  # role -> GB


async def full_capacity(
    router: str, serving: int, victim: str, killed: float, limit: float
) -> float | None:
    """Seconds from the kill until ``serving`` members are healthy, serving and on the newest
    version (None: not within ``limit`` seconds); the killed server ``victim`` counts only
    once the router has seen it lost (before that its listing is the one before the kill)."""
    seen_lost = False
    async with grpc.aio.insecure_channel(router) as channel:
        admin = router_pb2_grpc.RouterAdminStub(channel)
        while time.monotonic() - killed < limit:
            try:
                listed = await admin.ListBackends(router_pb2.ListBackendsRequest(), timeout=2)
                healthy = [
                    b for b in listed.backends if b.state == router_pb2.BACKEND_STATE_HEALTHY
                ]
                seen_lost = seen_lost or victim not in {b.address for b in healthy}
                if not seen_lost:
                    healthy = [b for b in healthy if b.address != victim]
                newest = max((b.weight_version for b in healthy), default=-1)
                current = [b for b in healthy if not b.standby and b.weight_version == newest]
                if len(current) >= serving:
                    return time.monotonic() - killed
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.05)
    return None


async def training(fleet: LocalFleet, mode: Mode, args: argparse.Namespace) -> None:
    import torch

    client = InferenceClient(fleet.addresses.router, fleet.addresses.servers, control_timeout=120)
    weights = load_file(str(ensure_tiny_model() / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    rng = random.Random(7)
    capacity: asyncio.Task[float | None] | None = None
    for step in range(args.steps):
        started = time.monotonic()
        batch = start_rollout(client, rng, args.sessions, args.tokens, "standby-bench")
        if step == args.kill_at:
            await asyncio.sleep(0.3)  # its generations under way
            victim, killed = fleet.addresses.servers[0], time.monotonic()
            await asyncio.to_thread(fleet.kill_server, 0)
            capacity = asyncio.ensure_future(
                full_capacity(fleet.addresses.router, args.servers, victim, killed, args.limit)
            )
            mode.kill_step = step
        await finish_step(client, batch, weights, generator, step, args.sessions, args.tokens, mode)
        mode.step_seconds.append(time.monotonic() - started)
    if capacity is not None:
        mode.full_after = await capacity
    await client.close()


def run_mode(args: argparse.Namespace, standby: int) -> Mode:
    mode = Mode(standby=standby)
    with LocalFleet(args.servers, standby=standby, on_event=mode.events.append) as fleet:
        fleet.supervise()
        if standby:
            pids = fleet.pids
            for role, index in (("serving", 0), ("standby", len(fleet.addresses.servers) - 1)):
                mode.memory[role] = sum(settle(pids[index]).values()) / GB
        asyncio.run(training(fleet, mode, args))
    return mode


def report(modes: list[Mode], args: argparse.Namespace) -> list[str]:
    lines = [
        "### kill -9 under an RL loop, with a warm standby and without",
        "",
        f"{args.servers} serving servers, the embedded model; each step {args.sessions} session "
        f"rollouts of {args.tokens} tokens, pause, a delta update, resume; server 0 killed "
        f"mid-rollout in step {args.kill_at}.",
        "",
        "| fleet | full capacity at the fleet's version after the kill (s) | generations lost "
        "| step (s): before the kill, median | the kill's step | worst after | updates tried "
        "again |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in modes:
        before = mode.step_seconds[: mode.kill_step]
        after = mode.step_seconds[mode.kill_step + 1 :]
        full = "not within the limit" if mode.full_after is None else f"{mode.full_after:.2f}"
        name = f"{args.servers} + {mode.standby} standby" if mode.standby else f"{args.servers}"
        lines.append(
            f"| {name} | {full} | {mode.lost} | {statistics.median(before):.2f} "
            f"| {mode.step_seconds[mode.kill_step]:.2f} | {max(after, default=0):.2f} "
            f"| {mode.retries} |"
        )
    for mode in modes:
        if mode.memory:
            lines += [
                "",
                f"Idle memory (USS of the process tree): a serving server "
                f"{mode.memory['serving']:.2f} GB, the standby {mode.memory['standby']:.2f} GB.",
            ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=2, help="serving servers")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=5, help="the step server 0 dies in")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--limit", type=float, default=300, help="seconds to wait for capacity")
    add_output_argument(parser, "fleet.md")
    args = parser.parse_args()
    modes = [run_mode(args, standby) for standby in (1, 0)]
    for mode in modes:
        print(f"-- {mode.standby} standby:\n" + "\n".join(mode.events[-12:]), flush=True)
    write_report(args.output, report(modes, args), "standby_bench")


if __name__ == "__main__":
    main()
