"""Fault test: 3 real servers, 64 concurrent sessions, kill -9 of one server mid-generation,
under the default (bounded-load) placement."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servers.fleet.local import LocalFleet
from skyrl_grpc.placement import BoundedLoadPolicy
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc, router_pb2, router_pb2_grpc
from tests.helpers.sessions import routed_to
from tests.helpers.waits import ENGINE_START_SECONDS, FLEET_TEST_TIMEOUT, running_on_engines, until
from trainer_client import InferenceClient, PauseMode

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(FLEET_TEST_TIMEOUT)]
SESSIONS = [f"fault-session-{i}" for i in range(64)]
MAX_TOKENS = 320


async def backend_states(channel: grpc.aio.Channel) -> dict[str, int]:
    listed = await router_pb2_grpc.RouterAdminStub(channel).ListBackends(
        router_pb2.ListBackendsRequest()
    )
    return {b.address: b.state for b in listed.backends}


def test_killed_server_mid_generation_loses_nothing_and_rejoins() -> None:
    async def scenario(stack: LocalFleet) -> None:
        client = InferenceClient(stack.addresses.router, stack.addresses.servers)
        victim = stack.addresses.servers[0]
        async with grpc.aio.insecure_channel(stack.addresses.router) as channel:
            homes = {s: await routed_to(channel, s) for s in SESSIONS}
            affected = [s for s in SESSIONS if homes[s] == victim]
            assert affected, "no session lives on the victim"
            prompts = [[1, 100 + i, 7, 9] for i in range(len(SESSIONS))]
            batch = asyncio.ensure_future(
                client.generate_batch(
                    prompts,
                    {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
                    session_ids=SESSIONS,
                )
            )
            await running_on_engines(client, 1, batch, servers=[victim])
            await asyncio.to_thread(stack.kill_server, 0)
            assert not batch.done(), "generation finished before the fault"
            results = await asyncio.wait_for(batch, 300)
            assert [len(r.token_ids) for r in results] == [MAX_TOKENS] * len(SESSIONS)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="")
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert (await backend_states(channel))[victim] == router_pb2.BACKEND_STATE_UNHEALTHY
            moved = {}
            for session in SESSIONS:
                moved[session] = await routed_to(channel, session)
                assert moved[session] != victim
                if session not in affected:
                    assert moved[session] == homes[session]  # only the lost server's moved
            await asyncio.to_thread(stack.restart_server, 0)
            healthy = router_pb2.BACKEND_STATE_HEALTHY
            await until(
                lambda: _state_is(channel, victim, healthy), what="the restarted server rejoined"
            )
            back = {s: await routed_to(channel, s) for s in affected}
            # Bounded-load placement keeps a moved session where its KV cache now is, unless
            # its server holds more than the bound: that excess goes to the rejoined server.
            assert all(back[s] in (moved[s], victim) for s in affected)
            assert any(back[s] == moved[s] for s in affected)
            assert any(back[s] == victim for s in affected)
            now = Counter(back.get(s, moved[s]) for s in SESSIONS)
            bound = BoundedLoadPolicy().capacity(len(SESSIONS), len(stack.addresses.servers))
            assert max(n for server, n in now.items() if server != victim) <= bound
            # The server that rejoined, holding no sessions, takes the next new one.
            assert await routed_to(channel, "fault-session-new") == victim

    with LocalFleet(3, start_timeout=ENGINE_START_SECONDS) as stack:
        asyncio.run(scenario(stack))


def test_a_server_killed_mid_stream_is_survived_on_the_direct_path_with_identical_tokens() -> None:
    """The client routing itself (no router hop) moves a cut generation to another server
    with the prompt plus the tokens so far; greedy output equals an uninterrupted run."""

    async def scenario(stack: LocalFleet) -> None:
        client = InferenceClient(stack.addresses.router, stack.addresses.servers)
        assert client.config.direct
        prompts = [[1, 300 + i, 7, 9] for i in range(8)]
        sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        sessions = [f"direct-fault-{i}" for i in range(8)]
        batch = asyncio.ensure_future(
            client.generate_batch(prompts, sampling, session_ids=sessions)
        )
        await running_on_engines(client, 1, batch)
        # Held where they are (a keep pause) until the kill has landed: on a busy machine this
        # process may get the CPU too late to cut any generation still running.
        await client.pause(PauseMode.KEEP)
        # The server running the most of them dies (the client placed the sessions: which
        # one holds any is its choice, not the test's).
        loads = await client.server_loads()
        servers = list(stack.addresses.servers)
        victim = max(servers, key=lambda server: loads[server].running_requests)
        assert loads[victim].running_requests > 0, "generation finished before the fault"
        await asyncio.to_thread(stack.kill_server, servers.index(victim))
        alive = next(server for server in servers if server != victim)
        survivor = InferenceClient(alive, [alive])
        await survivor.resume()
        results = await asyncio.wait_for(batch, 300)
        reference = await survivor.generate_batch(prompts, sampling)
        assert [r.token_ids for r in results] == [r.token_ids for r in reference]
        await client.close()
        await survivor.close()

    with LocalFleet(2, start_timeout=ENGINE_START_SECONDS) as stack:
        asyncio.run(scenario(stack))


def test_a_killed_router_is_restarted_at_its_address_and_sessions_keep_their_servers() -> None:
    """kill -9 of the router under 32 session generations: the client routing itself carries
    on from its last view (nothing lost); the supervisor starts the router again on the same
    gRPC and HTTP ports; it learns the fleet and where each session lives from the servers'
    own status feeds, so every session goes back to the server that holds it."""
    sessions = SESSIONS[:32]

    async def live_sessions(channel: grpc.aio.Channel) -> int:
        listed = await router_pb2_grpc.RouterAdminStub(channel).ListBackends(
            router_pb2.ListBackendsRequest()
        )
        healthy = [b for b in listed.backends if b.state == router_pb2.BACKEND_STATE_HEALTHY]
        return sum(b.live_sessions for b in healthy) if len(healthy) == 2 else -1

    async def scenario(stack: LocalFleet) -> None:
        events: list[str] = []
        stack.on_event = events.append
        stack.supervise()
        router, http_port = stack.addresses.router, stack.http_port
        client = InferenceClient(router, stack.addresses.servers)
        prompts = [[1, 500 + i, 7, 9] for i in range(len(sessions))]
        sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        batch = asyncio.ensure_future(
            client.generate_batch(prompts, sampling, session_ids=sessions)
        )
        await running_on_engines(client, 1, batch)
        async with grpc.aio.insecure_channel(router) as channel:
            # Asked all at once: one by one, on a busy machine, the generation could end first.
            placed = await asyncio.gather(*(routed_to(channel, s) for s in sessions))
        homes = dict(zip(sessions, placed, strict=True))
        killed = time.monotonic()
        await asyncio.to_thread(stack.kill_router)
        assert not batch.done(), "generation finished before the fault"
        async with grpc.aio.insecure_channel(router) as channel:
            # Back, at its address, knowing both servers and all 32 sessions (from the
            # servers' status feeds): waited for as an event, bounded for a busy machine.
            async def knows_every_session() -> bool:
                try:
                    return await live_sessions(channel) == len(sessions)
                except grpc.aio.AioRpcError:
                    return False  # not back yet

            await until(knows_every_session, 120, f"the router back with every session: {events}")
            back_after = time.monotonic() - killed
            results = await asyncio.wait_for(batch, 300)
            assert [len(r.token_ids) for r in results] == [MAX_TOKENS] * len(sessions)
            assert {s: await routed_to(channel, s) for s in sessions} == homes
        assert stack.addresses.router == router and stack.http_port == http_port
        assert any("router 0" in e and "is back" in e for e in events), events
        async with httpx.AsyncClient(timeout=30) as http:  # the OpenAI edge, same port
            assert (await http.get(f"http://127.0.0.1:{http_port}/v1/models")).status_code == 200
        print(f"router back and routing {back_after:.1f} s after kill -9")
        await client.close()

    with LocalFleet(
        2, router_args=["--http-port", "0"], start_timeout=ENGINE_START_SECONDS
    ) as stack:
        asyncio.run(scenario(stack))


def test_a_restarted_server_catches_up_from_its_peer_before_it_serves(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of a server after three weight updates and a LoRA adapter load: restarted, it
    reads the fleet's weights (ReadWeights) and adapters (ReadLoraAdapter) from its peer before
    reporting SERVING, with no trainer call: version 3, weight checksums bit-identical to the
    peer's, the adapter at its version with the same SHA-256, the same greedy outputs with and
    without it. Killed again while a weight update is open on its peer, it waits that update
    out and serves the version it commits, not the one before."""
    from safetensors.torch import load_file

    from tests.helpers.adapters import make_adapter
    from tests.helpers.weights import GREEDY, greedy_per_server, perturbed

    original = load_file(str(tiny_model_dir / "model.safetensors"))
    tensors, config = make_adapter(tiny_model_dir, seed=5)

    async def scenario(stack: LocalFleet) -> None:
        events: list[str] = []
        stack.on_event = events.append
        stack.supervise()
        client = InferenceClient(stack.addresses.router, stack.addresses.servers)
        for version in (1, 2, 3):
            await client.update_weights(perturbed(original, seed=version).items(), version)
        await client.load_lora("fleet-adapter", tensors=tensors, config=config, version=4)
        victim, peer = stack.addresses.servers
        killed = time.monotonic()
        await asyncio.to_thread(stack.kill_server, 0)
        await until(
            lambda: any("is back" in e for e in events),
            ENGINE_START_SECONDS,
            "the server's restart",
        )
        back_after = time.monotonic() - killed
        # Serving now, and already current: nothing was sent to it by the trainer.
        assert dict(await client.weight_versions()) == {victim: 3, peer: 3}
        sums = await client.weight_checksums()
        assert sums[victim] == sums[peer] and sums[victim]
        adapters = await client.list_loras()
        assert [(a.name, a.version) for a in adapters[victim]] == [("fleet-adapter", 4)]
        assert adapters[victim][0].sha256 == adapters[peer][0].sha256
        outputs = await greedy_per_server([victim, peer])
        assert outputs[victim] == outputs[peer]
        assert all(len(tokens) == GREEDY["max_tokens"] for tokens in outputs[victim])
        adapted = await greedy_per_server([victim, peer], lora="fleet-adapter")
        assert adapted[victim] == adapted[peer] != outputs[peer]
        print(f"server killed -> back, caught up on version 3 with its adapter: {back_after:.1f} s")
        events.clear()
        async with grpc.aio.insecure_channel(peer) as channel:
            control = control_plane_pb2_grpc.ControlPlaneStub(channel)
            opened = cp.StartWeightUpdateRequest(weight_version=4, owner="a trainer")
            await control.StartWeightUpdate(opened)  # open on the peer, not yet committed
            await asyncio.to_thread(stack.kill_server, 0)
            log = tmp_path / "server-0.log"

            def waiting() -> bool:
                return "catch-up: waiting for" in log.read_text()

            def back() -> bool:
                return any("is back" in e for e in events)

            await until(lambda: waiting() or back(), ENGINE_START_SECONDS, "the restart")
            assert waiting() and not back(), events  # it waits, not serving meanwhile
            committed = await control.FinishWeightUpdate(cp.FinishWeightUpdateRequest())
            assert committed.weight_version == 4
        await until(back, ENGINE_START_SECONDS, "the restart")
        assert dict(await client.weight_versions()) == {victim: 4, peer: 4}
        sums = await client.weight_checksums()
        assert sums[victim] == sums[peer]
        await client.close()

    lora = ["--enable-lora", "--max-lora-rank", "8"]
    with LocalFleet(
        2, engine_args=lora, log_dir=tmp_path, start_timeout=ENGINE_START_SECONDS
    ) as stack:
        asyncio.run(scenario(stack))


def test_the_collective_group_forms_again_after_a_server_restarts(tiny_model_dir: Path) -> None:
    """kill -9 of a server in the trainer's gloo group: restarted (and caught up from its
    peer), it is in no group; the trainer's next collective update forms the group again by
    itself, with no call of the trainer's, and commits on both servers."""
    from safetensors.torch import load_file

    from tests.helpers.weights import perturbed

    original = load_file(str(tiny_model_dir / "model.safetensors"))

    async def scenario(stack: LocalFleet) -> None:
        events: list[str] = []
        stack.on_event = events.append
        stack.supervise()
        client = InferenceClient(stack.addresses.router, stack.addresses.servers)
        first = await client.init_weight_transfer("gloo", timeout_seconds=60)
        await client.update_weights(perturbed(original, seed=1).items(), 1)
        victim, peer = stack.addresses.servers
        await asyncio.to_thread(stack.kill_server, 0)
        await until(
            lambda: any("is back" in e for e in events),
            ENGINE_START_SECONDS,
            "the server's restart",
        )
        assert (await client.weight_versions())[victim] == 1  # caught up from its peer
        commits = await client.update_weights(perturbed(original, seed=2).items(), 2)
        assert {a: c.weight_version for a, c in commits.items()} == {victim: 2, peer: 2}
        sums = await client.weight_checksums()
        assert sums[victim] == sums[peer] and sums[victim]
        assert client.has_weight_group and set(first) == {victim, peer}
        await client.close()

    with LocalFleet(2, log_dir=None, start_timeout=ENGINE_START_SECONDS) as stack:
        asyncio.run(scenario(stack))


async def _state_is(channel: grpc.aio.Channel, address: str, state: int) -> bool:
    return (await backend_states(channel))[address] == state
