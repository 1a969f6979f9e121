"""Warm standbys on real engines (``LocalFleet(standby=1)``, supervised): the standby takes
every weight update and no traffic; ``kill -9`` of the serving server under streaming
generations promotes it at once (the streams move there and complete), the killed server
comes back as the new standby, caught up, and the next weight update reaches every member.
Then the other one dies in the middle of a weight update (its bytes sent, before the commit): the update fails with every server
on its previous weights, the standby serves in its place, the update tried again commits
without the dead server, and it comes back as the standby at that version."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from safetensors.torch import load_file

from servers.fleet.local import LocalFleet
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from tests.helpers.waits import ENGINE_START_SECONDS, FLEET_TEST_TIMEOUT, running_on_engines, until
from tests.helpers.weights import perturbed
from trainer_client import InferenceClient, WeightUpdateError
from trainer_client.weights.weight_calls import ServerWeightCalls

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(FLEET_TEST_TIMEOUT)]
STREAMS = 8
MAX_TOKENS = 200
HEALTHY = router_pb2.BACKEND_STATE_HEALTHY


async def members(router: str) -> dict[str, router_pb2.Backend]:
    async with grpc.aio.insecure_channel(router) as channel:
        admin = router_pb2_grpc.RouterAdminStub(channel)
        listed = await admin.ListBackends(router_pb2.ListBackendsRequest(), timeout=10)
    return {b.address: b for b in listed.backends}


def test_a_warm_standby_takes_a_killed_servers_place_at_once_and_the_killed_one_stands_by(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = load_file(str(tiny_model_dir / "model.safetensors"))

    async def scenario(stack: LocalFleet) -> None:
        events: list[str] = []
        stack.on_event = events.append
        stack.supervise()
        serving, standby = stack.addresses.servers
        assert stack.addresses.standbys == (standby,)
        client = InferenceClient(stack.addresses.router, stack.addresses.servers)
        await client.update_weights(perturbed(original, seed=1).items(), 1)
        assert dict(await client.weight_versions()) == {serving: 1, standby: 1}
        sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        prompts = [[1, 200 + i, 7] for i in range(STREAMS)]
        sessions = [f"standby-{i}" for i in range(STREAMS)]
        # Its warm-up's tokens are counted: what matters is that traffic adds none.
        before = await members(stack.addresses.router)
        await client.generate_batch(prompts, {**sampling, "max_tokens": 4}, session_ids=sessions)

        async def served_by(address: str, at_least: int) -> bool:
            return (await members(stack.addresses.router))[address].prompt_tokens >= at_least

        await until(lambda: served_by(serving, before[serving].prompt_tokens + 1), what="counts")
        listed = await members(stack.addresses.router)
        assert listed[standby].standby
        assert listed[standby].prompt_tokens == before[standby].prompt_tokens  # no traffic

        batch = asyncio.ensure_future(
            client.generate_batch(prompts, sampling, session_ids=sessions)
        )
        await running_on_engines(client, 1, batch, servers=[serving])
        killed = time.monotonic()
        await asyncio.to_thread(stack.kill_server, 0)

        async def promoted() -> bool:
            now = (await members(stack.addresses.router))[standby]
            return not now.standby and now.state == HEALTHY and now.weight_version == 1

        await until(promoted, what="the standby's promotion", interval=0.05)
        promoted_after = time.monotonic() - killed
        assert not batch.done(), "the generations ended before the kill"
        results = await asyncio.wait_for(batch, 300)
        assert [len(r.token_ids) for r in results] == [MAX_TOKENS] * STREAMS
        assert promoted_after < 5.0, f"the standby served {promoted_after:.1f} s after the kill"
        assert any("promoted in place of server 0" in e for e in events), events

        await until(lambda: any("is back" in e for e in events), ENGINE_START_SECONDS, "restart")
        back_after = time.monotonic() - killed
        listed = await members(stack.addresses.router)
        assert listed[serving].standby and listed[serving].state == HEALTHY
        assert listed[serving].weight_version == 1  # caught up from its peer before serving
        assert stack.addresses.standbys == (serving,)
        await client.update_weights(perturbed(original, seed=2).items(), 2)
        assert dict(await client.weight_versions()) == {serving: 2, standby: 2}
        sums = await client.weight_checksums()
        assert sums[serving] == sums[standby]
        before = await members(stack.addresses.router)
        await client.generate_batch(prompts, {**sampling, "max_tokens": 4}, session_ids=sessions)
        await until(lambda: served_by(standby, before[standby].prompt_tokens + 1), what="counts")
        listed = await members(stack.addresses.router)
        assert listed[serving].prompt_tokens == before[serving].prompt_tokens  # it stands by
        # The promoted server dies in the middle of a weight update.
        events.clear()
        weights = perturbed(original, seed=3)

        finish = ServerWeightCalls.finish
        killed_at_commit: list[str] = []

        async def dying_at_commit(calls: ServerWeightCalls, address: str, version: int) -> Any:
            if not killed_at_commit:  # every byte sent, the commit not yet asked for
                killed_at_commit.append(address)
                await asyncio.to_thread(stack.kill_server, 1)
            return await finish(calls, address, version)

        monkeypatch.setattr(ServerWeightCalls, "finish", dying_at_commit)
        with pytest.raises(WeightUpdateError, match="kept its previous weights") as failed:
            await client.update_weights(weights.items(), 3)
        monkeypatch.setattr(ServerWeightCalls, "finish", finish)
        print(f"the update the death cut short: {failed.value}")
        assert dict(await client.weight_versions()) == {serving: 2}  # the standby: down
        assert not (await members(stack.addresses.router))[serving].standby
        await client.update_weights(weights.items(), 3)  # tried again: the dead one left out
        assert dict(await client.weight_versions()) == {serving: 3}
        await until(lambda: any("is back" in e for e in events), ENGINE_START_SECONDS, "restart")
        assert dict(await client.weight_versions()) == {serving: 3, standby: 3}
        assert stack.addresses.standbys == (standby,)
        sums = await client.weight_checksums()
        assert sums[serving] == sums[standby]
        print(
            f"kill -9 -> standby serving at version 1: {promoted_after:.2f} s; "
            f"killed server back as the standby: {back_after:.1f} s"
        )
        await client.close()

    with LocalFleet(1, standby=1, start_timeout=ENGINE_START_SECONDS) as stack:
        asyncio.run(scenario(stack))
