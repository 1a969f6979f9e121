"""A RayFleet that heals itself when a node leaves (its raylet killed mid-generation), on a Ray
cluster of three nodes simulated on this machine (``ray.cluster_utils.Cluster``): streams
migrate, the lost server is re-created on the surviving node and rejoins the router, and a
training step succeeds across the new fleet. Timings printed for the closing note."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from safetensors.torch import load_file

from servers.common.supervision import RestartPolicy
from servers.fleet.ray_group import RayFleet
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc
from tests.helpers.elastic import assert_nothing_lost, grow_and_shrink_under_training
from tests.helpers.ray_cluster import started_cluster
from tests.helpers.sessions import routed_to
from tests.helpers.waits import ENGINE_START_SECONDS, FLEET_TEST_TIMEOUT, running_on_engines, until
from trainer_client import InferenceClient

pytestmark = [pytest.mark.engine, pytest.mark.timeout(FLEET_TEST_TIMEOUT)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    import ray

    cluster = started_cluster()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@contextlib.asynccontextmanager
async def started_fleet(servers: int, **options: Any) -> AsyncIterator[tuple[RayFleet, list[str]]]:
    """A CPU-only ``RayFleet`` of ``servers`` (``options`` as it takes them), started, with the
    events it reports as they happen; closed after."""
    events: list[str] = []
    fleet = RayFleet(servers, cpu_only=True, **options)
    fleet.on_event = events.append
    await asyncio.to_thread(fleet.start)
    try:
        yield fleet, events
    finally:
        await asyncio.to_thread(fleet.close)


async def event_with(events: list[str], words: str, timeout: float) -> str:
    """The latest of ``events`` (the fleet's, appended as they happen) holding ``words``."""
    await until(lambda: any(words in e for e in events), timeout, f"an event with {words!r}")
    return [e for e in events if words in e][-1]


async def test_a_node_that_leaves_takes_its_server_and_the_fleet_heals(
    cluster: Any, tiny_model_dir: Any
) -> None:
    doomed = cluster.add_node(num_cpus=2, resources={"inference": 1})
    survivor = cluster.add_node(num_cpus=2, resources={"inference": 2})
    cluster.wait_for_nodes()
    async with started_fleet(2, strategy="SPREAD", resources={"inference": 1}) as (fleet, events):
        fleet.supervise(RestartPolicy(first_delay=0.5), interval=0.5)
        nodes = await asyncio.to_thread(fleet.node_ids)
        assert set(nodes) == {doomed.node_id, survivor.node_id}  # Ray's own view
        victim = nodes.index(doomed.node_id)
        old_address = fleet.addresses.servers[victim]
        client = InferenceClient(fleet.addresses.router, list(fleet.addresses.servers))
        prompts = [[1, 100 + i, 7] for i in range(32)]
        greedy = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
        sessions = [f"node-death-{i}" for i in range(32)]
        batch = asyncio.ensure_future(client.generate_batch(prompts, greedy, session_ids=sessions))
        await running_on_engines(client, 1, batch, servers=[old_address])
        left = time.monotonic()
        cluster.remove_node(doomed)  # its raylet and every process on it
        results = await asyncio.wait_for(batch, 300)  # migrated: every one completes
        assert [len(r.token_ids) for r in results] == [48] * 32
        back = await event_with(events, "is back", ENGINE_START_SECONDS)
        whole = time.monotonic() - left
        assert f"server {victim}" in back
        assert any("died" in e and "actor died" in e for e in events), events
        new_address = fleet.addresses.servers[victim]
        assert new_address != old_address
        assert (await asyncio.to_thread(fleet.node_ids))[victim] == survivor.node_id
        async with grpc.aio.insecure_channel(fleet.addresses.router) as channel:
            admin = router_pb2_grpc.RouterAdminStub(channel)
            states: dict[str, int] = {}

            async def new_healthy() -> bool:
                listed = await admin.ListBackends(router_pb2.ListBackendsRequest())
                states.clear()
                states.update({b.address: b.state for b in listed.backends})
                return states.get(new_address) == router_pb2.BACKEND_STATE_HEALTHY

            await until(new_healthy, 120, f"the router to see {new_address} healthy")
            assert old_address not in states
        # A training step across the new fleet with the client built before the server moved
        # (it follows the router's membership): pause, a fleet-wide update, resume.
        await client.pause("keep")
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        await client.update_weights(weights.items(), 1)
        await client.resume()
        stepped = time.monotonic() - left
        versions = await client.weight_versions()
        assert versions.consistent and versions.newest == 1, (dict(versions), events)
        assert set(versions) == {new_address, fleet.addresses.servers[1 - victim]}
        # The same greedy tokens as before the node left (the same weights, re-pushed).
        again = await client.generate_batch(prompts[:4], greedy, session_ids=sessions[:4])
        assert [r.token_ids for r in again] == [r.token_ids for r in results[:4]]
        print(f"\nnode left -> fleet whole: {whole:.1f} s; -> training step done: {stepped:.1f} s")
        await client.close()


async def test_on_ray_a_standby_takes_the_place_of_a_server_whose_node_left_and_it_returns_standing_by(
    cluster: Any,
) -> None:
    nodes = [cluster.add_node(num_cpus=2, resources={"standby": 2}) for _ in range(2)]
    cluster.wait_for_nodes()
    async with started_fleet(1, standby=1, strategy="SPREAD", resources={"standby": 1}) as (
        fleet,
        events,
    ):
        fleet.supervise(RestartPolicy(first_delay=0.5), interval=0.5)
        serving, standby = fleet.addresses.servers
        assert fleet.addresses.standbys == (standby,)
        placed = await asyncio.to_thread(fleet.node_ids)
        doomed = next(n for n in nodes if n.node_id == placed[0])
        client = InferenceClient(fleet.addresses.router, list(fleet.addresses.servers))
        greedy = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
        batch = asyncio.ensure_future(client.generate_batch([[1, 9, 7]] * 8, greedy))
        await running_on_engines(client, 1, batch, servers=[serving])
        left = time.monotonic()
        cluster.remove_node(doomed)
        async with grpc.aio.insecure_channel(fleet.addresses.router) as channel:
            admin = router_pb2_grpc.RouterAdminStub(channel)

            async def roles() -> dict[str, tuple[bool, int]]:
                listed = await admin.ListBackends(router_pb2.ListBackendsRequest())
                return {b.address: (b.standby, b.state) for b in listed.backends}

            async def promoted() -> bool:
                return (await roles()).get(standby) == (False, router_pb2.BACKEND_STATE_HEALTHY)

            await until(promoted, 60, "the standby's promotion", interval=0.05)
            promoted_after = time.monotonic() - left
            results = await asyncio.wait_for(batch, 300)
            assert [len(r.token_ids) for r in results] == [48] * 8
            await event_with(events, "is back", ENGINE_START_SECONDS)
            moved = fleet.addresses.servers[0]
            assert moved != serving and fleet.addresses.standbys == (moved,)

            async def standing_by() -> bool:
                return (await roles()).get(moved) == (True, router_pb2.BACKEND_STATE_HEALTHY)

            await until(standing_by, 120, f"{moved} back as the standby")
        assert promoted_after < 5.0, f"the standby served {promoted_after:.1f} s after"
        print(f"\nnode left -> standby serving: {promoted_after:.2f} s")
        await client.close()


async def test_a_server_that_dies_at_every_start_is_reported_after_bounded_tries(
    cluster: Any,
) -> None:
    cluster.add_node(num_cpus=2, resources={"crashy": 2})
    cluster.wait_for_nodes()
    async with started_fleet(1, resources={"crashy": 1}) as (fleet, events):
        # From now on every start fails: the model directory the server reads is gone.
        fleet.options.server_args = ["--model", "/nonexistent/model"]
        fleet.supervise(RestartPolicy(first_delay=0.1, max_failures=2), interval=0.2)
        fleet.kill_server(0)  # the actor dies
        reported = await event_with(events, "times in a row", 600)
        assert "failed 2 times in a row" in reported and "/nonexistent/model" in reported
        assert fleet.supervision is not None and fleet.supervision.restarts == [2]


async def test_scale_up_lands_on_a_new_node_caught_up_from_its_peer_and_takes_sessions(
    cluster: Any, tiny_model_dir: Any
) -> None:
    first = cluster.add_node(num_cpus=2, resources={"grow": 1})
    cluster.wait_for_nodes()
    async with started_fleet(1, resources={"grow": 1}) as (fleet, events):
        fleet.supervise(interval=0.5)
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        client = InferenceClient(fleet.addresses.router, list(fleet.addresses.servers))
        await client.update_weights(weights.items(), 1)
        await client.close()
        added = cluster.add_node(num_cpus=2, resources={"grow": 1})  # a node joins
        cluster.wait_for_nodes()
        await asyncio.to_thread(fleet.scale, 2)
        assert await asyncio.to_thread(fleet.node_ids) == [first.node_id, added.node_id]
        new = fleet.addresses.servers[1]
        client = InferenceClient(fleet.addresses.router, list(fleet.addresses.servers))
        # It read the fleet's weights from its peer before serving: current at once.
        assert dict(await client.weight_versions()) == {fleet.addresses.servers[0]: 1, new: 1}

        async def backend(address: str) -> Any:
            async with grpc.aio.insecure_channel(fleet.addresses.router) as channel:
                admin = router_pb2_grpc.RouterAdminStub(channel)
                listed = await admin.ListBackends(router_pb2.ListBackendsRequest())
            return next(b for b in listed.backends if b.address == address)

        sampling = {"temperature": 0.0, "max_tokens": 4}
        prompts = [[1, 40 + i] for i in range(8)]

        async def current() -> bool:  # the router's view of it
            return bool((await backend(new)).weight_version == 1)

        await until(current, 120, "the router to see the new server at weight version 1")
        batches = iter(range(1_000_000))

        async def takes_sessions() -> bool:
            # New sessions, until one is placed there (as the server reports): the client's
            # own view may lag the router's for a while on a busy machine (its feed is
            # reconnecting, say), and sessions placed from a view without the server stay put.
            batch = next(batches)
            ids = [f"h{batch}-{i}" for i in range(8)]
            await client.generate_batch(prompts, sampling, session_ids=ids)
            return bool((await backend(new)).live_sessions > 0)

        await until(takes_sessions, 120, "a new session placed on the new server")
        await client.close()
        # Shrinking drains the newest server and stops it.
        await asyncio.to_thread(fleet.scale, 1)
        assert len(fleet.addresses.servers) == 1
        assert any("drained and removed" in e for e in events), events


async def test_on_ray_a_fleet_grows_onto_a_new_node_and_shrinks_while_a_training_loop_runs(
    cluster: Any, tiny_model_dir: Any
) -> None:
    """1 -> 2 -> 1 servers on Ray while a loop generates, pauses, updates and resumes (as
    ``test_local_scale``'s loop does on local processes): the added server placed on a node
    that joined, caught up before its first call, in every step's update while it is a
    member, then drained and removed; no generation lost."""
    cluster.add_node(num_cpus=2, resources={"elastic": 1})
    cluster.add_node(num_cpus=2, resources={"elastic": 1})
    cluster.wait_for_nodes()
    async with started_fleet(1, resources={"elastic": 1}) as (fleet, events):
        fleet.supervise(interval=0.5)
        weights = load_file(str(tiny_model_dir / "model.safetensors"))
        run = await grow_and_shrink_under_training(fleet, weights)
        assert_nothing_lost(run, fleet.addresses.servers[0])
        assert any("drained and removed" in e for e in events), events
        assert not any("died" in e for e in events), events


async def test_a_killed_router_actor_is_back_at_its_address_with_sessions_on_their_servers(
    cluster: Any, tiny_model_dir: Any
) -> None:
    cluster.add_node(num_cpus=2, resources={"routed": 2})
    cluster.wait_for_nodes()
    async with started_fleet(2, resources={"routed": 1}) as (fleet, events):
        fleet.supervise(RestartPolicy(first_delay=0.5), interval=0.5)
        router = fleet.addresses.router
        client = InferenceClient(router, fleet.addresses.servers)
        sessions = [f"ray-router-{i}" for i in range(32)]
        prompts = [[1, 700 + i, 7, 9] for i in range(32)]
        greedy = {"temperature": 0.0, "max_tokens": 160, "ignore_eos": True}
        batch = asyncio.ensure_future(client.generate_batch(prompts, greedy, session_ids=sessions))
        await running_on_engines(client, 1, batch)
        async with grpc.aio.insecure_channel(router) as channel:
            placed = await asyncio.gather(*(routed_to(channel, s) for s in sessions))
        homes = dict(zip(sessions, placed, strict=True))
        killed = time.monotonic()
        await asyncio.to_thread(fleet.kill_router)
        back = await event_with(events, "routes to the fleet again", ENGINE_START_SECONDS)
        async with grpc.aio.insecure_channel(router) as channel:
            admin = router_pb2_grpc.RouterAdminStub(channel)
            lists: list[router_pb2.ListBackendsResponse] = []

            async def every_session_placed() -> bool:
                lists.append(await admin.ListBackends(router_pb2.ListBackendsRequest()))
                return sum(b.live_sessions for b in lists[-1].backends) == len(sessions)

            # Both servers known, every session's place learned from them.
            await until(every_session_placed, 300, f"every session placed again: {events}")
            listed = lists[-1]
            routing = time.monotonic() - killed
            assert {b.address for b in listed.backends} == set(fleet.addresses.servers)
            results = await asyncio.wait_for(batch, 300)
            assert [len(r.token_ids) for r in results] == [160] * len(sessions)
            assert {s: await routed_to(channel, s) for s in sessions} == homes
        assert fleet.addresses.router == router and "is back" in back, events
        print(f"\nrouter actor killed -> back and routing: {routing:.1f} s")
        await client.close()
