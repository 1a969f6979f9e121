"""Weight transfer into two real vLLM servers: both transports, verified, atomic, versioned."""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from servers.engine.transfer.handoff import HandoffBuffer
from skyrl_grpc.tensor_bytes import sha256_of
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc, data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.conftest import REFERENCE_PROMPTS, offline_reference
from tests.helpers.waits import running_on_engines, until
from tests.helpers.weights import MAX_TOKENS, greedy_per_server, next_version, perturbed
from trainer_client import FanOutError, InferenceClient, WeightUpdateError
from trainer_client.weights.weight_sending import push_messages

pytestmark = [pytest.mark.engine]
# Any version: the calls using it are refused before the version matters.
UNUSED_VERSION = 1 << 40


@dataclass
class PushedFleet:
    """Both real servers behind the router, a client of them and the model's original weights
    (restored after the module)."""

    client: InferenceClient
    servers: list[str]
    original: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
async def pushed_fleet(
    two_server_router: Any, engine_server: Any, second_engine_server: Any, tiny_model_dir: Path
) -> AsyncIterator[PushedFleet]:
    servers = [engine_server.address, second_engine_server.address]
    client = InferenceClient(two_server_router.address, servers)
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    yield PushedFleet(client, servers, original)
    # Leave the shared engines with their original weights.
    await client.update_weights(original.items(), transport="grpc")


@pytest.fixture(scope="module")
def new_weights(pushed_fleet: PushedFleet) -> dict[str, torch.Tensor]:
    return perturbed(pushed_fleet.original, seed=1)


def fresh_engine_greedy(
    weights: dict[str, torch.Tensor], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[list[int]]:
    """Greedy outputs of a fresh vLLM engine started from ``weights`` saved to disk."""
    saved = tmp_path_factory.mktemp("new-weights")
    for path in tiny_model_dir.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, saved / path.name)
    save_file(
        {n: t.contiguous() for n, t in weights.items()},
        str(saved / "model.safetensors"),
        metadata={"format": "pt"},
    )
    sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    return [
        r["token_ids"]
        for r in offline_reference(
            saved, REFERENCE_PROMPTS, sampling, tmp_path_factory.mktemp("ref")
        )
    ]


@pytest.fixture(scope="module")
def new_weights_reference(
    new_weights: dict[str, torch.Tensor],
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> list[list[int]]:
    return fresh_engine_greedy(new_weights, tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
async def original_greedy(pushed_fleet: PushedFleet) -> dict[str, list[list[int]]]:
    return await greedy_per_server(pushed_fleet.servers)


def sender_checksums(weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: sha256_of(t) for n, t in weights.items()}


async def assert_serving(
    pushed_fleet: PushedFleet,
    weights: dict[str, torch.Tensor],
    greedy: dict[str, list[list[int]]] | list[list[int]],
) -> None:
    client: InferenceClient = pushed_fleet.client
    checksums = await client.weight_checksums()
    for address in pushed_fleet.servers:
        assert checksums[address] == sender_checksums(weights), f"checksums differ on {address}"
    outputs = await greedy_per_server(pushed_fleet.servers)
    for address in pushed_fleet.servers:
        expected = greedy[address] if isinstance(greedy, dict) else greedy
        assert outputs[address] == expected, f"greedy output differs on {address}"


async def test_in_band_push_serves_exactly_the_new_weights_and_back(
    pushed_fleet: PushedFleet,
    new_weights: dict[str, torch.Tensor],
    new_weights_reference: list[list[int]],
    original_greedy: dict[str, list[list[int]]],
) -> None:
    client: InferenceClient = pushed_fleet.client
    assert all(
        o != r
        for o, r in zip(
            original_greedy[pushed_fleet.servers[0]], new_weights_reference, strict=True
        )
    )
    version = await next_version(client)
    finished = await client.update_weights(
        new_weights.items(), version, transport="grpc", chunk_bytes=64 << 10, release_memory=True
    )
    assert {r.weight_version for r in finished.values()} == {version}
    assert all(r.parameters_updated == len(new_weights) for r in finished.values())
    await assert_serving(pushed_fleet, new_weights, new_weights_reference)
    result = await client.generate(REFERENCE_PROMPTS[0], {"temperature": 0.0, "max_tokens": 4})
    assert [(s.weight_version, s.length) for s in result.weight_versions] == [(version, 4)]
    assert set((await client.weight_versions()).values()) == {version}
    # Every server committed, so each freed the weights it kept for a rollback, as asked.
    assert {i.rollback_weight_version for i in (await client.server_info()).values()} == {None}
    with pytest.raises(FanOutError, match="ReleaseRollback"):
        await client.rollback_weights(version)
    # Pushing the original weights back restores the original output exactly; by default the
    # previous weights stay for a rollback.
    await client.update_weights(pushed_fleet.original.items(), transport="grpc")
    await assert_serving(pushed_fleet, pushed_fleet.original, original_greedy)
    kept = {i.rollback_weight_version for i in (await client.server_info()).values()}
    assert kept == {version}


async def test_an_update_of_part_of_a_layer_reloads_that_layer_and_keeps_the_others(
    pushed_fleet: PushedFleet,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    original_greedy: dict[str, list[list[int]]],
) -> None:
    """The commit reloads only the decoder layers an update touched (vLLM's layerwise reload);
    a touched layer is reloaded whole, because vLLM fuses q/k/v and gate/up: sending q_proj and
    up_proj alone must leave k/v and gate as they were, and every other layer untouched."""
    client: InferenceClient = pushed_fleet.client
    generator = torch.Generator().manual_seed(7)
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    changed = {
        n: pushed_fleet.original[n]
        + 0.5 * torch.randn(pushed_fleet.original[n].shape, generator=generator)
        for n in names
    }
    expected = {**pushed_fleet.original, **changed}
    reference = fresh_engine_greedy(expected, tiny_model_dir, tmp_path_factory)
    assert reference != original_greedy[pushed_fleet.servers[0]]
    finished = await client.update_weights(changed.items(), transport="grpc", delta=False)
    assert all(r.parameters_updated == len(names) for r in finished.values())
    await assert_serving(pushed_fleet, expected, reference)
    await client.update_weights(pushed_fleet.original.items(), transport="grpc")
    await assert_serving(pushed_fleet, pushed_fleet.original, original_greedy)


async def test_a_push_handed_to_the_engine_in_small_pieces_serves_exactly_the_new_weights(
    pushed_fleet: PushedFleet,
    new_weights: dict[str, torch.Tensor],
    new_weights_reference: list[list[int]],
) -> None:
    """With 16 KB per worker call every parameter larger than that reaches the engine in
    pieces, each copied into place as it comes: the result is the sender's bytes exactly."""
    from tests.conftest import running_engine_server

    async for server in running_engine_server(weight_stage_batch_bytes=16 << 10):
        client = InferenceClient(server.address, [server.address])
        assert max(t.numel() * t.element_size() for t in new_weights.values()) > 8 * (16 << 10)
        await client.update_weights(new_weights.items(), 1, transport="grpc", chunk_bytes=4 << 10)
        checksums = await client.weight_checksums()
        assert checksums[server.address] == sender_checksums(new_weights)
        assert (await greedy_per_server([server.address]))[server.address] == new_weights_reference
        await client.close()


class UnseenBuffer(HandoffBuffer):
    """The server's shared-memory file as a worker on another host, or in a container with a
    /dev/shm of its own, sees it: not at all (removed as soon as the server mapped it)."""

    def _make(self) -> mmap.mmap:
        buffer = super()._make()
        self.mapped()  # removes the name; the server's mapping stays
        return buffer


async def test_a_worker_that_cannot_see_the_servers_shared_memory_gets_the_bytes_inline(
    pushed_fleet: PushedFleet,
    engine_server: Any,
    new_weights: dict[str, torch.Tensor],
    new_weights_reference: list[list[int]],
    original_greedy: dict[str, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker says why it cannot map the file; the server sends that batch again inline,
    and every later one, and the update serves exactly the sender's bytes."""
    client: InferenceClient = pushed_fleet.client
    workers = engine_server.state.started.weights.workers
    unseen = UnseenBuffer(workers._handoff.size)
    monkeypatch.setattr(workers, "_handoff", unseen)
    try:
        version = await next_version(client)
        await client.update_weights(new_weights.items(), version, transport="grpc")
        assert unseen.inline, "the server kept using a buffer its worker cannot see"
        await assert_serving(pushed_fleet, new_weights, new_weights_reference)
        # Inline from the start now (a delta this time: patches take the same path).
        await client.update_weights(pushed_fleet.original.items(), transport="grpc")
        await assert_serving(pushed_fleet, pushed_fleet.original, original_greedy)
    finally:
        unseen.close()


async def test_a_reload_that_fails_part_way_leaves_every_server_on_its_old_weights(
    pushed_fleet: PushedFleet,
    engine_server: Any,
    new_weights: dict[str, torch.Tensor],
    new_weights_reference: list[list[int]],
    original_greedy: dict[str, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """vLLM's layerwise reload raising in the middle of the new weights (some layers already
    reloaded, the rest not). Preparing a layer as it arrives (``prepared_layers``): the commit
    reloads that layer instead, and the update serves the new weights. The commit's reload:
    that server's commit fails, it reloads its previous weights, the fleet rolls back the
    server that had committed, the error says what happened, and the next update succeeds. The
    fault is a plugin in a fresh server's engine core (``tests.helpers.reload_fault``)."""
    from tests.conftest import running_engine_server
    from tests.helpers import reload_fault

    trigger = tmp_path / "break-a-reload"
    monkeypatch.setenv(reload_fault.TRIGGER, str(trigger))
    # The engine core is spawned with this process's sys.path (multiprocessing sets it there).
    monkeypatch.syspath_prepend(str(reload_fault.plugin_directory(tmp_path)))
    original = pushed_fleet.original
    async for fresh in running_engine_server(weight_commit_prepare=True):
        servers = [fresh.address, engine_server.address]
        client = InferenceClient(servers[0], servers, direct=False)
        await client.update_weights(original.items(), await next_version(client))  # one version
        reload_fault.arm(trigger, during="prepare")
        await client.update_weights(new_weights.items(), await next_version(client))
        assert not trigger.exists(), "no preparation broke"
        assert (await greedy_per_server(servers))[fresh.address] == new_weights_reference
        await client.update_weights(original.items(), await next_version(client))
        before = await client.weight_versions()
        # The commit reloads a layer only when its preparation failed: both break.
        reload_fault.arm(trigger, during="prepare")
        reload_fault.arm(trigger, during="commit")
        with pytest.raises(WeightUpdateError) as raised:
            await client.update_weights(new_weights.items(), await next_version(client))
        assert not trigger.exists(), "no reload broke"
        assert raised.value.consistent
        failed = raised.value.outcomes[fresh.address].what
        assert "previous weights restored" in failed and reload_fault.MESSAGE in failed, failed
        assert await client.weight_versions() == before
        checksums = await client.weight_checksums()
        assert all(checksums[a] == sender_checksums(original) for a in servers)
        greedy = await greedy_per_server(servers)
        assert all(greedy[a] == original_greedy[engine_server.address] for a in servers)
        # The next update succeeds on both, and so does going back.
        await client.update_weights(new_weights.items(), await next_version(client))
        assert (await greedy_per_server(servers))[fresh.address] == new_weights_reference
        await client.update_weights(original.items(), await next_version(client))
        await client.close()


async def test_collective_gloo_updates_two_servers_with_their_own_rank_offsets(
    pushed_fleet: PushedFleet,
    new_weights: dict[str, torch.Tensor],
    new_weights_reference: list[list[int]],
    original_greedy: dict[str, list[list[int]]],
) -> None:
    client: InferenceClient = pushed_fleet.client
    offsets = await client.init_weight_transfer("gloo", timeout_seconds=30)
    assert offsets == {pushed_fleet.servers[0]: 1, pushed_fleet.servers[1]: 2}
    # Small buckets: several broadcasts, parameters packed several to a bucket.
    await client.update_weights(new_weights.items(), transport="collective", bucket_bytes=300_000)
    await assert_serving(pushed_fleet, new_weights, new_weights_reference)
    await client.update_weights(pushed_fleet.original.items(), transport="collective")
    await assert_serving(pushed_fleet, pushed_fleet.original, original_greedy)
    # A corrupted bucket (checksums disagree with the bytes) is rejected everywhere.
    corrupt = dict(pushed_fleet.original)
    from trainer_client.weights import weight_sending as sender_module

    real_spec = sender_module.parameter_spec

    def lying_spec(name: str, tensor: Any, with_checksum: bool) -> cp.ParameterSpec:
        spec = real_spec(name, tensor, with_checksum)
        if name == "lm_head.weight":
            spec.sha256 = hashlib.sha256(b"something else").digest()
        return spec

    sender_module.parameter_spec = lying_spec
    try:
        with pytest.raises(WeightUpdateError) as raised:
            await client.update_weights(perturbed(corrupt, 5).items(), transport="collective")
    finally:
        sender_module.parameter_spec = real_spec
    assert raised.value.consistent
    for outcome in raised.value.outcomes.values():
        assert "DATA_LOSS: checksum mismatch for lm_head.weight" in outcome.what
    await assert_serving(pushed_fleet, pushed_fleet.original, original_greedy)


def control(address: str) -> control_plane_pb2_grpc.ControlPlaneAsyncStub:
    return control_plane_pb2_grpc.ControlPlaneStub(grpc.aio.insecure_channel(address))


async def push_raw(address: str, messages: list[cp.PushWeightsRequest]) -> grpc.StatusCode:
    stub = control(address)
    await stub.StartWeightUpdate(cp.StartWeightUpdateRequest())
    try:
        await stub.PushWeights(iter(messages))
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def stream_of(weights: dict[str, torch.Tensor]) -> list[cp.PushWeightsRequest]:
    return [
        cp.PushWeightsRequest.FromString(m)
        for m in push_messages(weights.items(), chunk_bytes=100_000)
    ]


async def test_every_rejected_update_leaves_the_old_weights_serving(
    pushed_fleet: PushedFleet, original_greedy: dict[str, list[list[int]]]
) -> None:
    address = pushed_fleet.servers[0]
    original = pushed_fleet.original
    changed = perturbed(original, 9)
    cases: dict[str, tuple[list[cp.PushWeightsRequest], grpc.StatusCode]] = {}
    unknown = stream_of({**changed, "model.no_such.weight": torch.zeros(2)})
    cases["unknown name"] = (unknown, grpc.StatusCode.INVALID_ARGUMENT)
    cases["shape mismatch"] = (
        stream_of({**changed, "lm_head.weight": torch.zeros(3, 3)}),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    cases["dtype mismatch"] = (
        stream_of({**changed, "lm_head.weight": changed["lm_head.weight"].half()}),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    cases["truncated"] = (stream_of(changed)[:-3], grpc.StatusCode.INVALID_ARGUMENT)
    corrupted = stream_of(changed)
    data = corrupted[5].chunk.data
    corrupted[5].chunk.data = bytes([data[0] ^ 1]) + data[1:]
    cases["checksum mismatch"] = (corrupted, grpc.StatusCode.DATA_LOSS)
    for name, (messages, code) in cases.items():
        assert await push_raw(address, messages) == code, name
        with pytest.raises(grpc.aio.AioRpcError) as raised:  # the update was closed
            await control(address).FinishWeightUpdate(
                cp.FinishWeightUpdateRequest(weight_version=UNUSED_VERSION)
            )
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name

    # The sender goes away mid-stream.
    stub = control(address)
    await stub.StartWeightUpdate(cp.StartWeightUpdateRequest())
    messages = stream_of(changed)

    async def then_vanish() -> AsyncIterator[cp.PushWeightsRequest]:
        for message in messages[:4]:
            yield message
        await asyncio.sleep(30)

    call = stub.PushWeights(then_vanish())

    async def server_state() -> cp.GetServerInfoResponse:
        return await stub.GetServerInfo(cp.GetServerInfoRequest())

    async def receiving() -> bool:
        return (await server_state()).open_weight_update.bytes_received > 0

    async def abandoned() -> bool:
        return not (await server_state()).HasField("open_weight_update")

    await until(receiving, what="the server to receive chunks of the stream")
    call.cancel()
    await until(abandoned, what="the server to abandon the update when the stream broke")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.FinishWeightUpdate(cp.FinishWeightUpdateRequest(weight_version=UNUSED_VERSION))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await assert_serving(pushed_fleet, original, original_greedy)


async def test_out_of_order_calls_are_failed_precondition(pushed_fleet: PushedFleet) -> None:
    stub = control(pushed_fleet.servers[1])
    for call in (
        stub.FinishWeightUpdate(cp.FinishWeightUpdateRequest(weight_version=UNUSED_VERSION)),
        stub.PushWeights(
            iter(stream_of({"lm_head.weight": pushed_fleet.original["lm_head.weight"]}))
        ),
        stub.CancelWeightUpdate(cp.CancelWeightUpdateRequest()),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "StartWeightUpdate" in (raised.value.details() or "")
    await stub.StartWeightUpdate(cp.StartWeightUpdateRequest())
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.FinishWeightUpdate(cp.FinishWeightUpdateRequest(weight_version=0))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "StartWeightUpdate named no version" in (raised.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.FinishWeightUpdate(cp.FinishWeightUpdateRequest(weight_version=-1))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "versions must increase" in (raised.value.details() or "")
    assert (await stub.CancelWeightUpdate(cp.CancelWeightUpdateRequest())).parameters_discarded == 0


async def test_update_while_paused_abort_then_retried_rollouts_report_both_versions(
    pushed_fleet: PushedFleet,
) -> None:
    client: InferenceClient = pushed_fleet.client
    before = (await client.weight_versions())[pushed_fleet.servers[0]]
    prompts = [[1, 60 + i, 61, 62] for i in range(6)]
    running = asyncio.ensure_future(
        client.generate_batch(
            prompts,
            {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True},
            session_ids=[f"w{i}" for i in range(6)],
        )
    )
    await running_on_engines(client, 6, running)
    await client.pause("abort")
    version = await next_version(client)
    await client.update_weights(
        perturbed(pushed_fleet.original, 3).items(), version, transport="grpc"
    )
    await client.resume()
    results = await asyncio.wait_for(running, 60)
    for result in results:
        assert len(result.token_ids) == 400
        versions = [s.weight_version for s in result.weight_versions]
        assert versions == [before, version], result.weight_versions
        assert sum(s.length for s in result.weight_versions) == 400
    await client.update_weights(pushed_fleet.original.items(), transport="grpc")


async def test_update_while_paused_keep_spans_report_both_versions(
    pushed_fleet: PushedFleet,
) -> None:
    client: InferenceClient = pushed_fleet.client
    address = pushed_fleet.servers[1]
    before = (await client.weight_versions())[address]
    channel = grpc.aio.insecure_channel(address)
    data = data_plane_pb2_grpc.DataPlaneStub(channel)
    requests = [
        data.Generate(
            data_plane_pb2.GenerateRequest(
                prompt_token_ids=[1, 70 + i, 3],
                sampling_params=gen.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
            )
        )
        for i in range(4)
    ]
    pending = [asyncio.ensure_future(r) for r in requests]
    # Pause as soon as the engine runs them all (the tiny model is fast: waiting risks their end).
    load_stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
    while (await load_stub.GetLoad(cp.GetLoadRequest())).running_requests < 4:
        assert not any(p.done() for p in pending)
        await asyncio.sleep(0.01)
    await client.pause("keep")
    assert not any(p.done() for p in pending), "the requests ended before the pause"
    version = await next_version(client)
    await client.update_weights(
        perturbed(pushed_fleet.original, 4).items(), version, transport="grpc"
    )
    await client.resume()
    responses = await asyncio.wait_for(asyncio.gather(*pending), 120)
    for response in responses:
        sample = response.samples[0]
        spans = [(s.weight_version, s.start, s.length) for s in sample.weight_versions]
        assert [s[0] for s in spans] == [before, version], spans
        assert spans[1][1] == spans[0][2] and spans[0][2] + spans[1][2] == 400
    await channel.close()
    await client.update_weights(pushed_fleet.original.items(), transport="grpc")
