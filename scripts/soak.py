"""The soak: a training loop and mixed traffic for minutes on a local fleet, with ``--chaos`` a
driver that kill -9s a random server or the router as it runs.

A local fleet (2 engine servers and a router, the embedded model, supervised) serves a trainer
loop: each step generates a batch of session rollouts (the client routing itself), pauses the
fleet (ABORT or KEEP), pushes new weights (a small step from the last: a delta) as that step's
version, and resumes. Beside it, ``--workers`` clients send single generations and streams,
with and without sessions, of uneven lengths. With ``--chaos`` a driver kills a random process
(a server or the router) with SIGKILL every ``--kill-every`` seconds (uniformly jittered) and
measures the time to full capacity: for a server, until it serves again at the fleet's version
(it catches up from its peer before serving); for the router, until it answers on its address
knowing both servers. Over the run: generations lost (a call that raised, or a sample cut
short), each step's versions (every server on one version after its update), requests still
running on the servers once it ends (leaked), and each long-lived process's resident memory and
open file descriptors, sampled every 10 s (after a warm-up, flat within 10% is the target).
Exits 1 when a generation was lost without chaos, a request leaked, or a server's memory grew
past ``--rss-growth``.

Run: .venv/bin/python -m scripts.soak --minutes 10
     .venv/bin/python -m scripts.soak --chaos --minutes 30 --kill-every 60 [--output docs/fleet.md]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from safetensors.torch import load_file

from scripts.bench_common import add_output_argument, tree_fds, tree_rss, write_report
from servers.fleet.local import LocalFleet
from skyrl_grpc.tiny_model import ensure_tiny_model
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from trainer_client import FanOutError, InferenceClient, PauseMode, WeightVersions

SESSIONS = 16
MAX_TOKENS = 48
SAMPLE_SECONDS = 10.0


@dataclass
class Run:
    steps: int = 0
    generations: int = 0
    lost: int = 0
    update_retries: int = 0
    split_versions: int = 0  # steps whose fleet served two versions after the update
    kills: list[dict[str, Any]] = field(default_factory=list)
    # role -> [(seconds since start, pid, RSS bytes of its process tree, open fds)]
    samples: dict[str, list[tuple[float, int, int, int]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # Beside the trainer: single generations and streams (requests, tokens, lost).
    traffic: dict[str, int] = field(default_factory=lambda: {"requests": 0, "tokens": 0})
    leaked: int = 0  # requests still running or waiting on the servers at the end


async def trainer(fleet: LocalFleet, run: Run, stop_at: float) -> None:
    import torch

    client = InferenceClient(fleet.addresses.router, fleet.addresses.servers, control_timeout=120)
    weights = load_file(str(ensure_tiny_model() / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    version = max((await client.weight_versions()).values())
    rng = random.Random(7)
    while time.monotonic() < stop_at:
        prompts = [[1, *(rng.randrange(3, 2000) for _ in range(8))] for _ in range(SESSIONS)]
        sessions = [f"chaos-{i}" for i in range(SESSIONS)]
        sampling = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        try:
            results = await client.generate_batch(prompts, sampling, session_ids=sessions)
            run.generations += len(results)
            run.lost += sum(1 for r in results if len(r.token_ids) != MAX_TOKENS)
        except Exception as error:  # every generation of the batch counts as lost
            run.lost += SESSIONS
            run.errors.append(f"generate: {error!r}"[:300])
        version += 1
        for tensor in weights.values():  # a small step: most elements change a little
            tensor.add_(1e-4 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
        while True:  # the step's update, again until the fleet takes it
            try:
                await client.pause(rng.choice([PauseMode.ABORT, PauseMode.ABORT, PauseMode.KEEP]))
                await client.update_weights(weights.items(), version)
                break
            except Exception as error:
                run.update_retries += 1
                run.errors.append(f"update {version}: {error!r}"[:300])
                await asyncio.sleep(1.0)
            finally:
                try:
                    await client.resume()
                except Exception as error:
                    run.errors.append(f"resume: {error!r}"[:300])
        try:
            versions = await client.weight_versions()
        except FanOutError as error:  # a server down or starting: what the others serve
            versions = WeightVersions(error.results)
        if len(set(versions.values())) > 1:
            run.split_versions += 1
        run.steps += 1
    await client.close()


async def traffic(fleet: LocalFleet, run: Run, stop_at: float, worker: int) -> None:
    """Single generations (whole, resubmitted after aborts) and streams beside the trainer,
    with and without sessions, of uneven lengths: none may be lost or cut short."""
    client = InferenceClient(fleet.addresses.router, fleet.addresses.servers, max_abort_retries=50)
    rng = random.Random(100 + worker)
    while time.monotonic() < stop_at:
        length = rng.choice([4, 16, 64, 160])
        prompt = [1, *(rng.randrange(3, 2000) for _ in range(rng.randrange(1, 30)))]
        session = f"traffic-{worker}-{rng.randrange(8)}" if rng.random() < 0.7 else None
        try:
            if rng.random() < 0.8:
                sampling = {"temperature": 1.0, "max_tokens": length, "ignore_eos": True}
                result = await client.generate(prompt, sampling, session_id=session)
                run.traffic["tokens"] += len(result.token_ids)
                run.lost += len(result.token_ids) != length
            else:
                greedy = {"temperature": 0.0, "max_tokens": 8}
                async for chunk in client.stream(prompt, greedy, session_id=session):
                    run.traffic["tokens"] += len(chunk.token_ids)
            run.traffic["requests"] += 1
        except Exception as error:  # every error counts; none is expected without chaos
            run.lost += 1
            run.errors.append(f"traffic: {error!r}"[:300])
    await client.close()


async def leaked_requests(fleet: LocalFleet) -> int:
    """Requests still running or waiting on the servers once the traffic has ended."""
    async with InferenceClient(fleet.addresses.router, fleet.addresses.servers) as client:
        await client.resume()
        await asyncio.sleep(1.0)
        loads = await client.server_loads()
    return sum(load.running_requests + load.waiting_requests for load in loads.values())


async def full_capacity(fleet: LocalFleet, target: str, killed: float) -> float:
    """Seconds from the kill until ``target`` (a server index, or "router") is whole again."""
    if target == "router":
        while True:
            try:
                async with grpc.aio.insecure_channel(fleet.addresses.router) as channel:
                    listed = await router_pb2_grpc.RouterAdminStub(channel).ListBackends(
                        router_pb2.ListBackendsRequest(), timeout=2
                    )
                healthy = [
                    b for b in listed.backends if b.state == router_pb2.BACKEND_STATE_HEALTHY
                ]
                if len(healthy) == len(fleet.addresses.servers):
                    return time.monotonic() - killed
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    # One client for the whole wait (the router is up: one kill at a time), asking every server.
    async with InferenceClient(fleet.addresses.router, fleet.addresses.servers) as client:
        while True:
            try:
                versions = await client.weight_versions(timeout=2)
                if (
                    len(versions) == len(fleet.addresses.servers)
                    and len(set(versions.values())) == 1
                ):
                    return time.monotonic() - killed
            except Exception:  # the killed server does not answer yet
                pass
            await asyncio.sleep(0.2)


async def chaos(fleet: LocalFleet, run: Run, stop_at: float, every: float, seed: int) -> None:
    rng = random.Random(seed)
    while True:
        await asyncio.sleep(rng.uniform(0.5 * every, 1.5 * every))
        if time.monotonic() > stop_at - every / 2:
            return
        targets = [str(i) for i in range(len(fleet.addresses.servers))] + ["router"]
        target = rng.choice(targets)
        killed = time.monotonic()
        if target == "router":
            await asyncio.to_thread(fleet.kill_router)
        else:
            await asyncio.to_thread(fleet.kill_server, int(target))
        seconds = await full_capacity(fleet, target, killed)
        run.kills.append({"target": target, "at": killed, "seconds": seconds})
        print(f"kill -9 {target}: whole again after {seconds:.1f} s", flush=True)


async def sampler(fleet: LocalFleet, run: Run, stop_at: float, started: float) -> None:
    import os

    while time.monotonic() < stop_at:
        pids = fleet.pids
        roles = [f"server {i}" for i in range(len(pids) - 1)] + ["router", "trainer"]
        for role, pid in zip(roles, [*pids, os.getpid()], strict=True):
            alone = role == "trainer"  # the fleet is the trainer's child
            rss, fds = tree_rss(pid, alone), tree_fds(pid, alone)
            if rss:
                sample = (time.monotonic() - started, pid, rss, fds)
                run.samples.setdefault(role, []).append(sample)
        await asyncio.sleep(SAMPLE_SECONDS)


def report(run: Run, minutes: float, warmup: float, chaos: bool) -> list[str]:
    lines = [
        f"\n### {'Chaos soak' if chaos else 'Soak'}, {minutes:.0f} minutes\n",
        f"Training steps {run.steps} (generate {SESSIONS} session rollouts of {MAX_TOKENS} "
        "tokens, pause, a delta weight update, resume); generations "
        f"{run.generations}, beside them {run.traffic['requests']} single generations and "
        f"streams ({run.traffic['tokens']} tokens); lost {run.lost}; steps whose fleet served "
        f"two versions after the update: {run.split_versions}; updates tried again (a server "
        f"down): {run.update_retries}; requests leaked: {run.leaked}.\n",
        "| kill -9 | at (s) | whole again after (s) |",
        "| --- | --- | --- |",
    ]
    start = min((k["at"] for k in run.kills), default=0.0)
    for kill in run.kills:
        name = "router" if kill["target"] == "router" else f"server {kill['target']}"
        lines.append(f"| {name} | {kill['at'] - start:.0f} | {kill['seconds']:.1f} |")
    for kind in ("router", "server"):
        times = [k["seconds"] for k in run.kills if (k["target"] == "router") == (kind == "router")]
        if times:
            lines.append(
                f"\n{kind} kills: {len(times)}, whole again after median "
                f"{statistics.median(times):.1f} s, worst {max(times):.1f} s."
            )
    lines += [
        "",
        "Resident memory and open fds of each process, per life (a killed process starts a "
        f"new one), from {warmup:.0f} s into that life to its last sample; lives shorter than "
        f"{2 * warmup:.0f} s are left out. Servers and the router count their child processes "
        "(a server's engine core); the trainer is this process alone:",
        "",
        "| process | life (s) | RSS after warm-up (MiB) | RSS at its end | growth "
        "| fds after warm-up | fds at its end |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for role, samples in sorted(run.samples.items()):
        lives: dict[int, list[tuple[float, int, int, int]]] = {}
        for sample in samples:
            lives.setdefault(sample[1], []).append(sample)
        for life in lives.values():
            born = life[0][0]
            if life[-1][0] - born < 2 * warmup:
                continue
            settled = [s for s in life if s[0] - born >= warmup]
            first, last = settled[0], settled[-1]
            lines.append(
                f"| {role} | {last[0] - born:.0f} | {first[2] / 2**20:.0f} | "
                f"{last[2] / 2**20:.0f} | {(last[2] - first[2]) / first[2]:+.1%} | "
                f"{first[3]} | {last[3]} |"
            )
    if run.errors:
        lines += ["", "First errors seen:", ""] + [f"- `{e}`" for e in run.errors[:8]]
    return lines


def grown(run: Run, warmup: float, bound: float) -> list[str]:
    """The server lives whose memory grew past ``bound`` (a fraction) after their warm-up."""
    found = []
    for role, samples in run.samples.items():
        if not role.startswith("server"):
            continue
        lives: dict[int, list[tuple[float, int, int, int]]] = {}
        for sample in samples:
            lives.setdefault(sample[1], []).append(sample)
        for life in lives.values():
            settled = [s for s in life if s[0] - life[0][0] >= warmup]
            if len(settled) > 1 and settled[-1][2] > (1 + bound) * settled[0][2]:
                found.append(f"{role} (pid {life[0][1]})")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--chaos", action="store_true", help="kill -9 a server or the router")
    parser.add_argument("--kill-every", type=float, default=60, help="seconds between kills")
    parser.add_argument("--workers", type=int, default=4, help="clients beside the trainer")
    parser.add_argument("--warmup-seconds", type=float, default=120)
    parser.add_argument(
        "--rss-growth", type=float, default=0.1, help="a server's growth after warm-up, at most"
    )
    parser.add_argument("--seed", type=int, default=1)
    add_output_argument(parser, "fleet.md")
    args = parser.parse_args()
    run = Run()
    events: list[str] = []
    with LocalFleet(2, router_args=["--http-port", "0"], on_event=events.append) as fleet:
        fleet.supervise()
        started = time.monotonic()
        stop_at = started + args.minutes * 60

        async def everything() -> None:
            await asyncio.gather(
                trainer(fleet, run, stop_at),
                *(traffic(fleet, run, stop_at, w) for w in range(args.workers)),
                *([chaos(fleet, run, stop_at, args.kill_every, args.seed)] if args.chaos else []),
                sampler(fleet, run, stop_at, started),
            )
            run.leaked = await leaked_requests(fleet)

        asyncio.run(everything())
    print("\n".join(events))
    lines = report(run, args.minutes, args.warmup_seconds, args.chaos)
    kind = "chaos_soak" if args.chaos else "soak"
    write_report(args.output, lines, f"{kind} {args.minutes:g} min")
    failed = [f"{run.leaked} requests leaked"] if run.leaked else []
    if run.lost and not args.chaos:
        failed.append(f"{run.lost} generations lost")
    failed += [
        f"{g} grew past {args.rss_growth:.0%}"
        for g in grown(run, args.warmup_seconds, args.rss_growth)
    ]
    print("FAIL: " + "; ".join(failed) if failed else "PASS", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
