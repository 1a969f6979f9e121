"""Weight updates that can neither wedge a fleet nor poison it, against real vLLM servers.

One fleet-wide transaction (a failure anywhere leaves every server on its previous weights and
the next update succeeds), versions checked before any weight travels, leases that free a fleet
an exited trainer left locked, non-finite weights refused, and no stale KV after pushing weights
back.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from safetensors.torch import load_file

from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc
from tests.conftest import running_engine_server
from tests.helpers.faulty_proxy import Fault, FaultyProxy
from tests.helpers.waits import until
from tests.helpers.weights import (
    SHARED_PREFIX,
    greedy_per_server,
    next_version,
    perturbed,
    update_while_a_prefix_is_held,
)
from trainer_client import InferenceClient, WeightUpdateError

pytestmark = [pytest.mark.engine]
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class GuardedFleet:
    """Two real servers, a client of both, the model's original weights and each server's
    greedy outputs on them."""

    client: InferenceClient
    servers: list[str]
    original: dict[str, Any]  # name -> tensor
    reference: Any


@pytest.fixture(scope="module")
async def guarded_fleet(
    engine_server: Any, second_engine_server: Any, tiny_model_dir: Path
) -> AsyncIterator[GuardedFleet]:
    servers = [engine_server.address, second_engine_server.address]
    client = InferenceClient(servers[0], servers)
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    await client.update_weights(original.items(), transport="grpc")
    reference = await greedy_per_server(servers)
    yield GuardedFleet(client, servers, original, reference)
    await client.cancel_weight_update()
    await client.update_weights(original.items(), transport="grpc")


def control(address: str) -> control_plane_pb2_grpc.ControlPlaneAsyncStub:
    return control_plane_pb2_grpc.ControlPlaneStub(grpc.aio.insecure_channel(address))


async def info(address: str) -> cp.GetServerInfoResponse:
    return await control(address).GetServerInfo(cp.GetServerInfoRequest())


async def assert_on_previous_weights(guarded_fleet: GuardedFleet, versions: dict[str, int]) -> None:
    """Every server serves the version it served before, with the same greedy outputs, and
    holds no open update."""
    for address in guarded_fleet.servers:
        state = await info(address)
        assert state.weight_version == versions[address], address
        assert not state.HasField("open_weight_update"), address
    assert await greedy_per_server(guarded_fleet.servers) == guarded_fleet.reference


async def test_a_version_refused_by_one_server_leaves_the_fleet_on_its_previous_weights(
    guarded_fleet: GuardedFleet,
) -> None:
    client: InferenceClient = guarded_fleet.client
    first, second = guarded_fleet.servers
    # The second server is ahead (e.g. it was updated alone): it refuses the fleet's version.
    ahead = await next_version(client) + 5
    alone = InferenceClient(second, [second])
    await alone.update_weights(guarded_fleet.original.items(), ahead, transport="grpc")
    before = await client.weight_versions()
    with pytest.raises(WeightUpdateError) as raised:
        await client.update_weights(
            perturbed(guarded_fleet.original, 11).items(), ahead - 1, transport="grpc"
        )
    error = raised.value
    assert error.phase == "StartWeightUpdate"
    assert "INVALID_ARGUMENT" in error.outcomes[second].what
    assert error.outcomes[first].serving_version == before[first]
    await assert_on_previous_weights(guarded_fleet, before)
    # The next update goes through on both (the newest version + 1 by default).
    finished = await client.update_weights(guarded_fleet.original.items(), transport="grpc")
    assert {r.weight_version for r in finished.values()} == {ahead + 1}
    assert await greedy_per_server(guarded_fleet.servers) == guarded_fleet.reference


async def test_an_unreachable_server_leaves_no_update_open_on_the_others(
    guarded_fleet: GuardedFleet, unused_tcp_port: int
) -> None:
    reachable = guarded_fleet.servers[0]
    gone = f"127.0.0.1:{unused_tcp_port}"
    client = InferenceClient(reachable, [reachable, gone], control_timeout=5)
    version = await InferenceClient(reachable, [reachable]).weight_versions()
    with pytest.raises(WeightUpdateError) as raised:
        await client.update_weights(perturbed(guarded_fleet.original, 12).items(), transport="grpc")
    assert "UNAVAILABLE" in raised.value.outcomes[gone].what
    assert raised.value.outcomes[gone].serving_version is None  # it could not be asked
    state = await info(reachable)
    assert not state.HasField("open_weight_update")
    assert state.weight_version == version[reachable]
    # An update of the reachable server alone succeeds.
    alone = InferenceClient(reachable, [reachable])
    finished = await alone.update_weights(guarded_fleet.original.items(), transport="grpc")
    assert finished[reachable].weight_version == version[reachable] + 1


ABANDONING_TRAINER = """
import asyncio, sys
from skyrl_grpc.v1 import control_plane_pb2 as cp, control_plane_pb2_grpc
import grpc

async def main() -> None:
    for address in sys.argv[1].split(","):
        async with grpc.aio.insecure_channel(address) as channel:
            await control_plane_pb2_grpc.ControlPlaneStub(channel).StartWeightUpdate(
                cp.StartWeightUpdateRequest(owner="crashing-trainer", lease_seconds=2)
            )

asyncio.run(main())
"""


async def test_an_update_whose_trainer_exited_expires_with_its_lease(
    guarded_fleet: GuardedFleet,
) -> None:
    servers = guarded_fleet.servers
    exited = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", ABANDONING_TRAINER, ",".join(servers)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert exited.returncode == 0, exited.stderr
    state = await info(servers[0])
    assert state.open_weight_update.owner == "crashing-trainer"
    assert state.open_weight_update.lease_seconds == 2
    client: InferenceClient = guarded_fleet.client
    with pytest.raises(WeightUpdateError, match="owner crashing-trainer"):
        await client.update_weights(guarded_fleet.original.items(), transport="grpc")

    async def expired() -> bool:
        return not any([(await info(a)).HasField("open_weight_update") for a in servers])

    await until(expired, what="the lease to expire")
    await client.update_weights(guarded_fleet.original.items(), transport="grpc")
    assert await greedy_per_server(servers) == guarded_fleet.reference


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
async def test_non_finite_weights_are_refused_and_change_nothing(
    guarded_fleet: GuardedFleet, value: float
) -> None:
    client: InferenceClient = guarded_fleet.client
    before = await client.weight_versions()
    poisoned = perturbed(guarded_fleet.original, 13)
    poisoned["model.layers.1.mlp.down_proj.weight"].view(-1)[17] = value
    for transport in ("grpc", "collective"):
        if transport == "collective":
            await client.init_weight_transfer("gloo")
        with pytest.raises(WeightUpdateError) as raised:
            await client.update_weights(poisoned.items(), transport=transport)
        for outcome in raised.value.outcomes.values():
            assert "INVALID_ARGUMENT" in outcome.what
            assert "model.layers.1.mlp.down_proj.weight holds a NaN or an infinity" in outcome.what
        await assert_on_previous_weights(guarded_fleet, before)


FAULTS = [
    Fault("StartWeightUpdate", "before"),
    Fault("StartWeightUpdate", "after"),
    Fault("PushWeights", "before"),
    Fault("PushWeights", "midway"),
    Fault("PushWeights", "after"),
    Fault("FinishWeightUpdate", "before"),
    Fault("FinishWeightUpdate", "after"),
]


async def test_each_call_of_an_update_failing_on_one_server_leaves_the_fleet_consistent(
    guarded_fleet: GuardedFleet,
) -> None:
    first, second = guarded_fleet.servers
    proxy = await FaultyProxy(second).start()
    try:
        # In-band over gRPC, through the proxy: a push socket would bypass its faults.
        client = InferenceClient(first, [first, proxy.address], push_socket=False)
        for number, fault in enumerate(FAULTS):
            before = {first: (await info(first)).weight_version}
            before[second] = (await info(second)).weight_version
            proxy.fault = fault
            with pytest.raises(WeightUpdateError) as raised:
                await client.update_weights(
                    perturbed(guarded_fleet.original, 20 + number).items(), transport="grpc"
                )
            assert proxy.faults_injected[-1] == f"{fault.method}:{fault.when}"
            assert raised.value.consistent, str(raised.value)
            await assert_on_previous_weights(guarded_fleet, before)
            # The next update succeeds on both.
            finished = await client.update_weights(guarded_fleet.original.items(), transport="grpc")
            assert len({r.weight_version for r in finished.values()}) == 1, str(fault)
    finally:
        await proxy.stop()


async def test_no_stale_prefix_blocks_after_pushing_the_original_weights_back(
    guarded_fleet: GuardedFleet,
) -> None:
    """The prefix cache cannot be reset while paused requests hold blocks; requests after the
    update must still never reuse blocks computed under the weights it replaced."""
    address = guarded_fleet.servers[0]
    client = InferenceClient(address, [address])
    prompts = [[*SHARED_PREFIX, 500 + i] for i in range(32)]
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    reference = [r.token_ids for r in await client.generate_batch(prompts, greedy)]
    await client.update_weights(perturbed(guarded_fleet.original, 30).items(), transport="grpc")
    changed = [r.token_ids for r in await client.generate_batch(prompts, greedy)]
    assert changed != reference
    holding = await update_while_a_prefix_is_held(client, guarded_fleet.original)
    restored = [r.token_ids for r in await client.generate_batch(prompts, greedy)]
    await holding
    assert sum(r == e for r, e in zip(restored, reference, strict=True)) == 32


async def test_readme_loop_from_step_zero_on_a_fresh_fleet(tiny_model_dir: Path) -> None:
    """The README's trainer loop, verbatim in what it calls, on a server that has never been
    updated (it serves version 0)."""
    async for server in running_engine_server():
        client = InferenceClient(server.address, [server.address])
        assert await client.weight_versions() == {server.address: 0}
        model = load_file(str(tiny_model_dir / "model.safetensors"))
        for step in range(2):
            await client.pause("abort")
            await client.update_weights(model.items(), weight_version=step + 1, transport="grpc")
            await client.resume()
        assert await client.weight_versions() == {server.address: 2}
        await client.close()


@pytest.mark.parametrize("transport", ["grpc", "collective"])
async def test_allowed_non_finite_weights_leave_no_trace_once_replaced(
    tiny_model_dir: Path, transport: str
) -> None:
    """With --allow-non-finite-weights, NaN weights serve (garbage), in-band and over the
    collective; once good weights are back, the very first batch is exact: their traces in KV
    cache memory are cleared."""
    async for server in running_engine_server(allow_non_finite_weights=True):
        client = InferenceClient(server.address, [server.address])
        if transport == "collective":
            await client.init_weight_transfer("gloo")
        original = load_file(str(tiny_model_dir / "model.safetensors"))
        prompts = [[1, 100 + i, 200 + i, *range(300, 315)] for i in range(32)]
        greedy = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
        reference = [r.token_ids for r in await client.generate_batch(prompts, greedy)]
        poisoned = {n: t.clone() for n, t in original.items()}
        poisoned["model.layers.0.self_attn.q_proj.weight"].view(-1)[5] = float("nan")
        await client.update_weights(poisoned.items(), transport=transport)  # type: ignore[arg-type]
        garbage = [r.token_ids for r in await client.generate_batch(prompts, greedy)]
        assert sum(g == r for g, r in zip(garbage, reference, strict=True)) == 0
        await client.update_weights(original.items(), transport=transport)  # type: ignore[arg-type]
        first = [r.token_ids for r in await client.generate_batch(prompts, greedy)]
        assert sum(f == r for f, r in zip(first, reference, strict=True)) == 32
        await client.close()


class _RefusingControlPlane(control_plane_pb2_grpc.ControlPlaneServicer):
    """A server that says it takes gloo (so the client sends it the call) but refuses to join
    any weight-transfer group."""

    async def GetServerInfo(self, request, context):  # type: ignore[no-untyped-def]
        gloo = cp.Capabilities(weight_transfer_backends=[cp.WEIGHT_TRANSFER_BACKEND_GLOO])
        return cp.GetServerInfoResponse(world_size=1, capabilities=gloo)

    async def InitWeightTransfer(self, request, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this server refuses to join")


async def test_a_server_refusing_to_join_frees_the_group_at_once(engine_server: Any) -> None:
    # The real server starts joining; the other refuses. The trainer must give the rendezvous
    # up at once (not after the group's timeout), free its master port and leave the real
    # server able to join again.
    from servers.common.listener import bind, server_options
    from skyrl_grpc.process_group import free_port

    refusing = grpc.aio.server(options=server_options())
    refusing_servicer = _RefusingControlPlane()  # type: ignore[abstract]  # the calls it refuses
    control_plane_pb2_grpc.add_ControlPlaneServicer_to_server(refusing_servicer, refusing)
    refusing_address = f"127.0.0.1:{bind(refusing, '127.0.0.1:0', None)}"
    await refusing.start()
    try:
        port = free_port("127.0.0.1")
        both = InferenceClient(engine_server.address, [engine_server.address, refusing_address])
        started = asyncio.get_running_loop().time()
        with pytest.raises(Exception, match="refuses to join"):
            await both.init_weight_transfer("gloo", master_port=port, timeout_seconds=60)
        assert asyncio.get_running_loop().time() - started < 10
        alone = InferenceClient(engine_server.address, [engine_server.address])
        offsets = await asyncio.wait_for(
            alone.init_weight_transfer("gloo", master_port=port, timeout_seconds=60), 30
        )
        assert offsets == {engine_server.address: 1}
    finally:
        await refusing.stop(0)
