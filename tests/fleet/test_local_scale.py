"""LocalFleet.scale: a server added reads the fleet's weights from its peer before it serves
(so it joins the router current and takes sessions at once; the placement rule that keeps
calls off a server behind is tests/contract/test_placement.py's), the trainer's next update includes
it, and a removed one is drained first and not mistaken for a dead one by the supervisor (real
engine processes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from safetensors.torch import load_file

from servers.fleet.local import LocalFleet
from skyrl_grpc.v1 import router_pb2
from tests.helpers.elastic import assert_nothing_lost, grow_and_shrink_under_training, listed
from tests.helpers.waits import ENGINE_START_SECONDS, FLEET_TEST_TIMEOUT, until
from trainer_client import InferenceClient

pytestmark = [pytest.mark.engine, pytest.mark.timeout(FLEET_TEST_TIMEOUT)]


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
    events: list[str] = []
    engine_args = ["--model", str(tiny_model_dir), "--cpu-threads", "1"]
    fleet = LocalFleet(
        1, engine_args=engine_args, on_event=events.append, start_timeout=ENGINE_START_SECONDS
    )
    await asyncio.to_thread(fleet.start)
    try:
        fleet.supervise()
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        run = await grow_and_shrink_under_training(fleet, weights)
        assert_nothing_lost(run, fleet.addresses.servers[0])
        assert not any("died" in e for e in events), events
    finally:
        await asyncio.to_thread(fleet.close)
