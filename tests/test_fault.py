"""Fault tests on real server processes: kill -9 of a server mid-generation (3 servers, 64
concurrent sessions, bounded-load placement), mid-stream on the direct path, of the router, and
of a server that must catch up from its peer or rejoin the trainer's collective group."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servers.fleet.local import LocalFleet
from servers.fleet.supervision import RestartPolicy
from skyrl_grpc.placement import BoundedLoadPolicy
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from tests.helpers.sessions import end_sessions_at, routed_to
from tests.helpers.waits import running_on_engines, until
from trainer_client import InferenceClient

pytestmark = [pytest.mark.engine, pytest.mark.slow]
SESSIONS = [f"fault-session-{i}" for i in range(64)]
MAX_TOKENS = 320


class SupervisedFleet:
    """Two supervised servers (LoRA on) and a router with its HTTP edge, shared by the tests
    that kill a process and wait for the supervisor to bring it back: starting a fleet is most
    of such a test's time. ``events``: the supervisors' lines since the test began."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.stack = LocalFleet(
            2,
            engine_args=["--enable-lora", "--max-lora-rank", "8"],
            router_args=["--http-port", "0"],
            log_dir=None,
            on_event=self.events.append,
            # Each test kills a process that served for seconds: a new failure, not a streak.
            restart_policy=RestartPolicy(reset_after=5.0),
        )


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def shared() -> Iterator[SupervisedFleet]:
    fleet = SupervisedFleet()
    with fleet.stack:
        fleet.stack.supervise()
        yield fleet


@pytest.fixture
def supervised(shared: SupervisedFleet) -> SupervisedFleet:
    """The shared fleet, ready: every process up (what an earlier test killed is back), the
    router seeing every server healthy, and no session left by an earlier test."""
    stack = shared.stack

    async def ready() -> bool:
        if stack.supervision is None or stack.supervision.given_up:
            raise AssertionError(f"the supervisor gave up: {shared.events}")
        if not all(alive(pid) for pid in stack.pids):
            return False
        try:
            async with grpc.aio.insecure_channel(stack.addresses.router) as channel:
                states = await backend_states(channel)
        except grpc.aio.AioRpcError:
            return False
        return sorted(states) == sorted(stack.addresses.servers) and all(
            state == router_pb2.BACKEND_STATE_HEALTHY for state in states.values()
        )

    asyncio.run(until(ready, 600, f"the shared fleet to be whole again: {shared.events}"))
    asyncio.run(end_sessions_at(list(stack.addresses.servers)))
    shared.events.clear()
    return shared


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
            deadline = time.monotonic() + 30
            while (await backend_states(channel))[victim] != router_pb2.BACKEND_STATE_HEALTHY:
                assert time.monotonic() < deadline, "the restarted server did not rejoin"
                await asyncio.sleep(0.2)
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

    with LocalFleet(3) as stack:
        asyncio.run(scenario(stack))


def test_a_server_killed_mid_stream_is_survived_on_the_direct_path_with_identical_tokens(
    supervised: SupervisedFleet,
) -> None:
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
        # The server running the most of them dies (the client placed the sessions: which
        # one holds any is its choice, not the test's).
        loads = await client.server_loads()
        servers = list(stack.addresses.servers)
        victim = max(servers, key=lambda server: loads[server].running_requests)
        await asyncio.to_thread(stack.kill_server, servers.index(victim))
        assert not batch.done(), "generation finished before the fault"
        results = await asyncio.wait_for(batch, 300)
        alive = next(server for server in servers if server != victim)
        survivor = InferenceClient(alive, [alive])
        reference = await survivor.generate_batch(prompts, sampling)
        assert [r.token_ids for r in results] == [r.token_ids for r in reference]
        await client.close()
        await survivor.close()

    asyncio.run(scenario(supervised.stack))


def test_a_killed_router_is_restarted_at_its_address_and_sessions_keep_their_servers(
    supervised: SupervisedFleet,
) -> None:
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
        events = supervised.events
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
            while True:
                try:
                    if await live_sessions(channel) == len(sessions):
                        break
                except grpc.aio.AioRpcError:
                    pass
                assert time.monotonic() - killed < 120, f"the router did not come back: {events}"
                await asyncio.sleep(0.1)
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

    asyncio.run(scenario(supervised.stack))


def test_a_restarted_server_catches_up_from_its_peer_before_it_serves(
    tiny_model_dir: Path, supervised: SupervisedFleet
) -> None:
    """kill -9 of a server after three weight updates and a LoRA adapter load: restarted, it
    reads the fleet's weights (ReadWeights) and adapters (ReadLoraAdapter) from its peer before
    reporting SERVING, with no trainer call: version 3, weight checksums bit-identical to the
    peer's, the adapter at its version with the same SHA-256, the same greedy outputs with and
    without it."""
    from safetensors.torch import load_file

    from tests.helpers.adapters import make_adapter
    from tests.helpers.weights import GREEDY, greedy_per_server, next_version, perturbed

    original = load_file(str(tiny_model_dir / "model.safetensors"))
    tensors, config = make_adapter(tiny_model_dir, seed=5)

    async def scenario(stack: LocalFleet) -> None:
        events = supervised.events
        client = InferenceClient(stack.addresses.router, stack.addresses.servers)
        first = await next_version(client)  # the shared fleet may serve earlier tests' pushes
        newest = first + 2
        for version in range(first, newest + 1):
            await client.update_weights(perturbed(original, seed=version).items(), version)
        await client.load_lora("fleet-adapter", tensors=tensors, config=config, version=4)
        victim, peer = stack.addresses.servers
        killed = time.monotonic()
        await asyncio.to_thread(stack.kill_server, 0)
        await until(lambda: any("is back" in e for e in events), 300, "the server's restart")
        back_after = time.monotonic() - killed
        # Serving now, and already current: nothing was sent to it by the trainer.
        assert dict(await client.weight_versions()) == {victim: newest, peer: newest}
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
        print(
            f"server killed -> back, caught up on version {newest} with its adapter: "
            f"{back_after:.1f} s"
        )
        await client.unload_lora("fleet-adapter")
        await client.close()

    asyncio.run(scenario(supervised.stack))


def test_the_collective_group_forms_again_after_a_server_restarts(
    tiny_model_dir: Path, supervised: SupervisedFleet
) -> None:
    """kill -9 of a server in the trainer's gloo group: restarted (and caught up from its
    peer), it is in no group; the trainer's next collective update forms the group again by
    itself, with no call of the trainer's, and commits on both servers."""
    from safetensors.torch import load_file

    from tests.helpers.weights import next_version, perturbed

    original = load_file(str(tiny_model_dir / "model.safetensors"))

    async def scenario(stack: LocalFleet) -> None:
        events = supervised.events
        client = InferenceClient(stack.addresses.router, stack.addresses.servers)
        first = await client.init_weight_transfer("gloo", timeout_seconds=60)
        version = await next_version(client)  # the shared fleet may serve earlier tests' pushes
        await client.update_weights(perturbed(original, seed=1).items(), version)
        victim, peer = stack.addresses.servers
        await asyncio.to_thread(stack.kill_server, 0)
        await until(lambda: any("is back" in e for e in events), 300, "the server's restart")
        assert (await client.weight_versions())[victim] == version  # caught up from its peer
        commits = await client.update_weights(perturbed(original, seed=2).items(), version + 1)
        assert {a: c.weight_version for a, c in commits.items()} == {
            victim: version + 1,
            peer: version + 1,
        }
        sums = await client.weight_checksums()
        assert sums[victim] == sums[peer] and sums[victim]
        assert client.has_weight_group and set(first) == {victim, peer}
        await client.close()

    asyncio.run(scenario(supervised.stack))
