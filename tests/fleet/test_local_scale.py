"""LocalFleet.scale: a server added reads the fleet's weights from its peer before it serves
(so it joins the router current and takes sessions at once; the placement rule that keeps
calls off a server behind is tests/contract/test_placement.py's), the trainer's next update includes
it, and a removed one is drained first and not mistaken for a dead one by the supervisor (real
engine processes)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from safetensors.torch import load_file

from servers.fleet.local import LocalFleet
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from tests.helpers.waits import ENGINE_START_SECONDS, FLEET_TEST_TIMEOUT, until
from trainer_client import InferenceClient

pytestmark = [pytest.mark.engine, pytest.mark.timeout(FLEET_TEST_TIMEOUT)]


async def listed(router: str) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(router) as channel:
        admin = router_pb2_grpc.RouterAdminStub(channel)
        response = await admin.ListBackends(router_pb2.ListBackendsRequest())
    return {b.address: b for b in response.backends}


async def test_a_fleet_scales_up_caught_up_from_a_peer_and_scales_down_by_draining(
    tiny_model_dir: Path,
) -> None:
    events: list[str] = []
    # --cpu-threads 1: the embedded model's one thread (a --model directory otherwise gets
    # vLLM's per-core binding, OpenMP threads spinning on the other test worker's cores).
    engine_args = ["--model", str(tiny_model_dir), "--cpu-threads", "1"]
    fleet = LocalFleet(
        1,
        engine_args=engine_args,
        on_event=events.append,
        start_timeout=ENGINE_START_SECONDS,
    )
    await asyncio.to_thread(fleet.start)
    try:
        fleet.supervise()
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        first = InferenceClient(fleet.addresses.router, list(fleet.addresses.servers))
        await first.update_weights(weights.items(), 1)
        await asyncio.to_thread(fleet.scale, 2)
        old, new = fleet.addresses.servers

        # A client built before the fleet grew reaches the new server too (it follows the
        # router's membership), without being rebuilt.
        async def both_reached() -> bool:
            return set(await first.weight_versions()) == {old, new}

        await until(both_reached, what="the client built before the fleet grew to reach both")
        await first.close()
        client = InferenceClient(fleet.addresses.router, [old, new], direct=False)
        sampling = {"temperature": 0.0, "max_tokens": 4}
        prompts = [[1, 60 + i] for i in range(6)]

        async def new_healthy() -> bool:
            members = await listed(fleet.addresses.router)
            return bool(members[new].state == router_pb2.BACKEND_STATE_HEALTHY)

        await until(new_healthy, what=f"the router to see {new} healthy")
        assert dict(await client.weight_versions()) == {old: 1, new: 1}  # caught up
        sums = await client.weight_checksums()
        assert sums[new] == sums[old]
        await client.generate_batch(prompts, sampling, session_ids=[f"g{i}" for i in range(6)])
        assert (await listed(fleet.addresses.router))[new].total_requests > 0  # at once
        await client.update_weights(weights.items(), 2)
        assert dict(await client.weight_versions()) == {old: 2, new: 2}
        await client.close()
        await asyncio.to_thread(fleet.scale, 1)
        assert fleet.addresses.servers == (old,)
        assert list(await listed(fleet.addresses.router)) == [old]
        supervision = fleet.supervision
        assert supervision is not None
        seen = supervision.passes
        # Two passes after the removal: one at least began after it and looked at every
        # server; a removed server mistaken for a dead one is reported there.
        await until(lambda: supervision.passes >= seen + 2, what="two supervision passes")
        assert not any("died" in e for e in events), events
        assert any(f"server 1 ({new}) drained and removed" in e for e in events), events
    finally:
        await asyncio.to_thread(fleet.close)


async def test_a_fleet_grows_and_shrinks_while_a_training_loop_runs_and_loses_nothing(
    tiny_model_dir: Path,
) -> None:
    """1 -> 2 -> 1 servers while a loop generates, pauses, updates and resumes: no generation
    lost, every step's update on every member, the added server on the fleet's version before
    the router gave it its first call."""
    import torch

    events: list[str] = []
    engine_args = ["--model", str(tiny_model_dir), "--cpu-threads", "1"]
    fleet = LocalFleet(
        1, engine_args=engine_args, on_event=events.append, start_timeout=ENGINE_START_SECONDS
    )
    await asyncio.to_thread(fleet.start)
    stop = asyncio.Event()
    steps: list[dict[str, int]] = []  # each step's versions after its update
    lost, retried = [0], [0]
    first_call_versions: dict[str, tuple[int, int]] = {}  # added server -> (its, the fleet's)
    try:
        fleet.supervise()
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        client = InferenceClient(fleet.addresses.router, list(fleet.addresses.servers))

        async def loop() -> None:
            sampling = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}
            while not stop.is_set() or len(steps) < 3:
                prompts = [[1, 30 + i, 5] for i in range(8)]
                sessions = [f"elastic-{len(steps)}-{i}" for i in range(8)]
                results = await client.generate_batch(prompts, sampling, session_ids=sessions)
                lost[0] += sum(1 for r in results if len(r.token_ids) != 24)
                for tensor in weights.values():
                    tensor.add_(1e-4 * torch.randn(tensor.shape, dtype=tensor.dtype))
                version = len(steps) + 1
                while True:  # as a trainer does: a step that met a server leaving, again
                    try:
                        await client.pause("abort")
                        await client.update_weights(weights.items(), version)
                        await client.resume()
                        break
                    except Exception:
                        retried[0] += 1
                        await asyncio.sleep(0.5)
                steps.append(dict(await client.weight_versions()))
                # The trainer's own work between steps (a backward pass): it also leaves the
                # cores to the other test worker's engines, as a busy loop here would not.
                await asyncio.sleep(0.5)

        async def watch_first_calls() -> None:
            baseline: dict[str, int] = {}  # its warm-up's tokens, counted before it joined
            while not stop.is_set():
                members = await listed(fleet.addresses.router)
                healthy = [
                    m for m in members.values() if m.state == router_pb2.BACKEND_STATE_HEALTHY
                ]
                newest = max((m.weight_version for m in healthy), default=0)
                for address, member in members.items():
                    if address == fleet.addresses.servers[0] or address in first_call_versions:
                        continue
                    baseline.setdefault(address, member.prompt_tokens)
                    if member.prompt_tokens > baseline[address]:
                        first_call_versions[address] = (member.weight_version, newest)
                await asyncio.sleep(0.05)

        training = asyncio.ensure_future(loop())
        watching = asyncio.ensure_future(watch_first_calls())
        await until(lambda: len(steps) >= 2, ENGINE_START_SECONDS, "two steps")
        await asyncio.to_thread(fleet.scale, 2)
        added = fleet.addresses.servers[1]
        await until(lambda: added in first_call_versions, 300, "the added server's first call")
        await until(lambda: any(added in s for s in steps), 300, "a step on both")
        await asyncio.to_thread(fleet.scale, 1)
        shrunk_at = len(steps)  # a step under way may still have met the removed server
        await until(lambda: len(steps) >= shrunk_at + 2, 300, "a whole step after the removal")
        stop.set()
        await asyncio.wait_for(training, 300)
        watching.cancel()
        assert lost[0] == 0
        assert all(len(set(versions.values())) == 1 for versions in steps), steps
        assert steps[-1] == {fleet.addresses.servers[0]: len(steps)}
        assert any(added in versions for versions in steps)
        its, the_fleets = first_call_versions[added]
        # Caught up before it joined: not the version it started from (0). Each server's
        # status reaches the router up to a second apart, so the listing may show the fleet's
        # newest commit on one server before the other: one version's lag is the report's.
        assert its > 0 and the_fleets - 1 <= its <= the_fleets, first_call_versions
        assert not any("died" in e for e in events), events
        print(
            f"\n{len(steps)} steps, {retried[0]} tried again, first call on the added server "
            f"at version {its} (the fleet's {the_fleets})"
        )
        await client.close()
    finally:
        stop.set()
        await asyncio.to_thread(fleet.close)
