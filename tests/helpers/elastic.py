"""A fleet grown 1 -> 2 -> 1 while a training loop runs (local processes and Ray alike): the
loop generates a batch with sessions, pauses, pushes new weights, resumes, again and again; a
watcher notes the version the added server served when the router gave it its first call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from servers.fleet import Fleet
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from tests.helpers.waits import ENGINE_START_SECONDS, until
from trainer_client import InferenceClient, InferenceError

TOKENS = 24


async def listed(router: str) -> dict[str, Any]:
    """The router's members by address."""
    async with grpc.aio.insecure_channel(router) as channel:
        admin = router_pb2_grpc.RouterAdminStub(channel)
        response = await admin.ListBackends(router_pb2.ListBackendsRequest())
    return {b.address: b for b in response.backends}


@dataclass
class ElasticRun:
    """What the loop saw: each step's versions after its update, generations short of their
    tokens, steps tried again, and the added server's (version, the fleet's) at its first
    call."""

    added: str = ""
    steps: list[dict[str, int]] = field(default_factory=list)
    lost: int = 0
    retried: int = 0
    first_call_versions: dict[str, tuple[int, int]] = field(default_factory=dict)


async def grow_and_shrink_under_training(fleet: Fleet, weights: dict[str, Any]) -> ElasticRun:
    """Runs the loop on ``fleet`` (one server, started and supervised), grows it to two once
    two steps are done, shrinks it back to one once a step reached both, and returns after two
    more whole steps."""
    import torch

    run = ElasticRun()
    stop = asyncio.Event()
    first = fleet.addresses.servers[0]
    client = InferenceClient(fleet.addresses.router, list(fleet.addresses.servers))

    async def loop() -> None:
        sampling = {"temperature": 1.0, "max_tokens": TOKENS, "ignore_eos": True}
        while not stop.is_set() or len(run.steps) < 3:
            prompts = [[1, 30 + i, 5] for i in range(8)]
            sessions = [f"elastic-{len(run.steps)}-{i}" for i in range(8)]
            results = await client.generate_batch(prompts, sampling, session_ids=sessions)
            run.lost += sum(1 for r in results if len(r.token_ids) != TOKENS)
            for tensor in weights.values():
                tensor.add_(1e-4 * torch.randn(tensor.shape, dtype=tensor.dtype))
            version = len(run.steps) + 1
            while True:  # as a trainer does: a step that met a server leaving, again
                try:
                    await client.pause("abort")
                    await client.update_weights(weights.items(), version)
                    await client.resume()
                    break
                except Exception:
                    run.retried += 1
                    await asyncio.sleep(0.5)
            while True:  # the versions after it, from the members then (one may be leaving)
                try:
                    run.steps.append(dict(await client.weight_versions()))
                    break
                except InferenceError:
                    run.retried += 1
                    await asyncio.sleep(0.5)
            # The trainer's own work between steps (a backward pass): it also leaves the
            # cores to the other test worker's engines, as a busy loop here would not.
            await asyncio.sleep(0.5)

    async def watch_first_calls() -> None:
        baseline: dict[str, int] = {}  # its warm-up's tokens, counted before it joined
        while not stop.is_set():
            members = await listed(fleet.addresses.router)
            healthy = [m for m in members.values() if m.state == router_pb2.BACKEND_STATE_HEALTHY]
            newest = max((m.weight_version for m in healthy), default=0)
            for address, member in members.items():
                if address == first or address in run.first_call_versions:
                    continue
                baseline.setdefault(address, member.prompt_tokens)
                if member.prompt_tokens > baseline[address]:
                    run.first_call_versions[address] = (member.weight_version, newest)
            await asyncio.sleep(0.05)

    training = asyncio.ensure_future(loop())
    watching = asyncio.ensure_future(watch_first_calls())

    def steps(count: int) -> Callable[[], bool]:
        """Whether ``count`` steps are done; a loop that died raises its error here instead
        of leaving the wait to time out."""

        def done() -> bool:
            if training.done() and len(run.steps) < count:
                training.result()
                raise AssertionError(f"the loop ended after {len(run.steps)} steps")
            return len(run.steps) >= count

        return done

    try:
        await until(steps(2), ENGINE_START_SECONDS, "two steps")
        await asyncio.to_thread(fleet.scale, 2)
        run.added = fleet.addresses.servers[1]
        await until(
            lambda: run.added in run.first_call_versions, 300, "the added server's first call"
        )
        await until(lambda: any(run.added in s for s in run.steps), 300, "a step on both")
        await asyncio.to_thread(fleet.scale, 1)
        shrunk_at = len(run.steps)  # a step under way may still have met the removed server
        await until(steps(shrunk_at + 2), 300, "a whole step after removal")
        stop.set()
        await asyncio.wait_for(training, 300)
    finally:
        stop.set()
        training.cancel()
        watching.cancel()
        await asyncio.gather(training, watching, return_exceptions=True)
        await client.close()
    return run


def every_update_on_every_member(steps: list[dict[str, int]]) -> bool:
    """Whether each step's versions are one version, but for a server listed the first time:
    it caught up from a peer before it served, and may have read the version the fleet served
    then while the trainer committed one or two more (``CATCH_UP_ROUNDS`` asks again, a fleet
    stepping faster than a read takes outruns it). It is never ahead, it never serves a call
    while behind (``first_call_versions``), and from the next step on it is on every one."""
    seen: set[str] = set()
    for versions in steps:
        joined = {a: v for a, v in versions.items() if a not in seen}
        members = {a: v for a, v in versions.items() if a in seen} or versions
        if len(set(members.values())) != 1:
            return False
        if any(v > max(members.values()) for v in joined.values()):
            return False
        seen.update(versions)
    return True


def assert_nothing_lost(run: ElasticRun, remaining: str) -> None:
    """No generation short, every step's update on every member, the last on ``remaining``
    alone, and the added server on the fleet's version at its first call."""
    assert run.lost == 0
    assert every_update_on_every_member(run.steps), run.steps
    assert run.steps[-1] == {remaining: len(run.steps)}
    assert any(run.added in versions for versions in run.steps)
    its, the_fleets = run.first_call_versions[run.added]
    # Caught up before it joined: not the version it started from (0). Each server's status
    # reaches the router up to a second apart, so the listing may show the fleet's newest
    # commit on one server before the other: one version's lag is the report's.
    assert its > 0 and the_fleets - 1 <= its <= the_fleets, run.first_call_versions
    print(
        f"\n{len(run.steps)} steps, {run.retried} tried again, first call on the added server "
        f"at version {its} (the fleet's {the_fleets})"
    )
