"""Weight updates that send only what changed, against real vLLM servers: a delta gives the
same weights as a full push (the servers' SHA-256 checksums, and greedy outputs), a server on
another version gets everything inside the same transaction, and bad patches are refused with
the serving weights unchanged."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
import pytest
import torch
from safetensors.torch import load_file

from skyrl_grpc.chunk_wire import encode_chunk
from skyrl_grpc.names import PUSH_WEIGHTS
from skyrl_grpc.tensor_bytes import sha256_of
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc
from tests.helpers.weights import greedy_per_server, next_version, perturbed
from trainer_client import InferenceClient, WeightUpdateError
from trainer_client.exceptions import ServerError
from trainer_client.weights.delta_patches import weight_patches
from trainer_client.weights.weight_sending import parameter_spec

pytestmark = [pytest.mark.engine]


@dataclass
class DeltaFleet:
    """Both real servers, a client of them, and the model's original weights (restored after
    the module)."""

    client: InferenceClient
    servers: list[str]
    original: dict[str, torch.Tensor]

    @property
    def full_bytes(self) -> int:
        """The model's bytes: what a whole push sends each server."""
        return sum(t.numel() * t.element_size() for t in self.original.values())


@pytest.fixture(scope="module")
async def delta_fleet(
    engine_server: Any, second_engine_server: Any, tiny_model_dir: Path
) -> AsyncIterator[DeltaFleet]:
    servers = [engine_server.address, second_engine_server.address]
    client = InferenceClient(servers[0], servers, direct=False)
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    yield DeltaFleet(client, servers, original)
    await client.cancel_weight_update()
    await client.update_weights(original.items(), delta=False)
    await client.close()


def a_training_step(
    weights: dict[str, torch.Tensor], seed: int, fraction: float = 0.02
) -> dict[str, torch.Tensor]:
    """About ``fraction`` of each tensor's elements changed (2%: as a small RL step changes
    them; 12-25% at a higher learning rate)."""
    generator = torch.Generator().manual_seed(seed)
    stepped = {}
    for name, tensor in weights.items():
        mask = torch.rand(tensor.shape, generator=generator) < fraction
        noise = 1e-3 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        stepped[name] = torch.where(mask, tensor + noise, tensor)
    return stepped


async def served_checksums(client: InferenceClient) -> dict[str, dict[str, bytes]]:
    return await client.weight_checksums()


def expected_checksums(weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: sha256_of(tensor) for name, tensor in weights.items()}


async def test_a_delta_gives_the_same_weights_as_a_full_push(delta_fleet: DeltaFleet) -> None:
    client, servers = delta_fleet.client, delta_fleet.servers
    full_bytes = delta_fleet.full_bytes
    first = perturbed(delta_fleet.original, seed=21)
    version = await next_version(client)
    await client.update_weights(first.items(), version)  # no base yet: everything
    assert client.last_push_bytes == dict.fromkeys(servers, full_bytes)

    stepped = a_training_step(first, seed=22)
    began = time.monotonic()
    result = await client.update_weights(stepped.items(), version + 1)
    waited = time.monotonic() - began
    # Where it waited: each phase timed once, within the call (the record: the delta's base).
    assert set(result.phases) == {"start", "transfer", "commit", "record"}
    assert 0 < sum(result.phases.values()) <= waited
    # ~2% of the elements, each as a 4-byte index and a 4-byte value: about 4% of the bytes.
    assert all(0 < sent < 0.1 * full_bytes for sent in client.last_push_bytes.values())
    checksums = await served_checksums(client)
    assert checksums == dict.fromkeys(servers, expected_checksums(stepped))
    after_delta = await greedy_per_server(servers)

    # The same weights pushed whole: the same checksums and the same greedy outputs.
    await client.update_weights(stepped.items(), version + 2, delta=False)
    assert client.last_push_bytes == dict.fromkeys(servers, full_bytes)
    assert await served_checksums(client) == checksums
    assert await greedy_per_server(servers) == after_delta

    # delta=False kept no base: the next update sends everything again, and keeps one.
    await client.update_weights(stepped.items(), version + 3)
    assert client.last_push_bytes == dict.fromkeys(servers, full_bytes)
    # Nothing changed since: nothing but the manifest travels, and the version moves on.
    await client.update_weights(stepped.items(), version + 4)
    assert client.last_push_bytes == dict.fromkeys(servers, 0)
    assert set((await client.weight_versions()).values()) == {version + 4}


async def test_a_reserved_delta_base_is_the_first_records_memory_and_never_its_values(
    delta_fleet: DeltaFleet,
) -> None:
    servers = delta_fleet.servers
    client = InferenceClient(servers[0], servers, direct=False)
    try:
        first = perturbed(delta_fleet.original, seed=41)
        # Reserved like the model, plus a name the updates never push and one of another shape.
        misfit = sorted(first)[0]
        like = {**first, "not.pushed": torch.ones(3), misfit: torch.ones(2, 2)}
        await client.reserve_delta_base(like.items())
        reserved_record = client.weights.local.reserved_record
        assert reserved_record is not None
        reserved = {name: tensor.data_ptr() for name, tensor in reserved_record.items()}
        version = await next_version(client)
        await client.update_weights(first.items(), version)  # no base yet: everything
        record = client.weights.local.last_pushed
        assert record is not None and set(record.tensors) == set(first)
        reused = {n for n, t in record.tensors.items() if t.data_ptr() == reserved[n]}
        assert reused == set(first) - {misfit}  # copied into; the misfit cloned
        assert all(torch.equal(record.tensors[n], first[n]) for n in first)

        # The record is the pushed values: a delta against it serves exactly the new weights.
        stepped = a_training_step(first, seed=42)
        await client.update_weights(stepped.items(), version + 1)
        assert all(
            0 < sent < 0.1 * delta_fleet.full_bytes for sent in client.last_push_bytes.values()
        )
        assert await served_checksums(client) == dict.fromkeys(servers, expected_checksums(stepped))
    finally:
        await client.close()


async def test_a_server_on_another_version_gets_everything_in_the_same_transaction(
    delta_fleet: DeltaFleet,
) -> None:
    client, (first_server, second_server) = delta_fleet.client, delta_fleet.servers
    full_bytes = delta_fleet.full_bytes
    base = perturbed(delta_fleet.original, seed=31)
    version = await next_version(client)
    await client.update_weights(base.items(), version)
    # Another trainer moves the second server on (as a restarted or separately updated one).
    other = InferenceClient(second_server, [second_server], direct=False)
    await other.update_weights(perturbed(delta_fleet.original, seed=32).items(), version + 1)
    await other.close()

    stepped = a_training_step(base, seed=33)
    await client.update_weights(stepped.items(), version + 2)
    assert client.last_push_bytes[first_server] < 0.1 * full_bytes  # a patch
    assert client.last_push_bytes[second_server] == full_bytes  # its base is not the client's
    assert await served_checksums(client) == dict.fromkeys(
        delta_fleet.servers, expected_checksums(stepped)
    )


def bad_patches(
    tensor: torch.Tensor, serving: int
) -> list[tuple[int, list[int], list[float], grpc.StatusCode, str]]:
    """Patches of ``tensor`` a server serving version ``serving`` refuses: (the version the
    patch names, its indices, its values, the status, words of the message)."""
    return [
        (
            serving + 7,
            [0],
            [1.0],
            grpc.StatusCode.FAILED_PRECONDITION,
            f"apply to version {serving + 7}, but this server serves version {serving}",
        ),
        (
            serving,
            [tensor.numel()],
            [1.0],
            grpc.StatusCode.INVALID_ARGUMENT,
            f"names element {tensor.numel()}",
        ),
        (serving, [3, 1], [1.0, 2.0], grpc.StatusCode.INVALID_ARGUMENT, "strictly increasing"),
        (serving, [0], [float("nan")], grpc.StatusCode.INVALID_ARGUMENT, "NaN or an infinity"),
    ]


def _patch(
    name: str, tensor: torch.Tensor, base_version: int, indices: list[int], values: list[float]
) -> tuple[cp.ParameterSpec, torch.Tensor]:
    """A hand-made patch of ``tensor`` (any indices and values, good or bad): its spec and its
    bytes, uint32 indices then values."""
    spec = parameter_spec(name, tensor, with_checksum=False)
    spec.patch.base_weight_version = base_version
    spec.patch.changed = len(indices)
    payload = torch.tensor(indices, dtype=torch.int32).view(torch.uint8)
    payload = torch.cat([payload, torch.tensor(values, dtype=tensor.dtype).view(torch.uint8)])
    return spec, payload


def _patch_stream(
    name: str, tensor: torch.Tensor, base_version: int, indices: list[int], values: list[float]
) -> list[bytes]:
    spec, payload = _patch(name, tensor, base_version, indices, values)
    manifest = cp.PushWeightsRequest(manifest=cp.WeightManifest(parameters=[spec]))
    return [manifest.SerializeToString(), encode_chunk(name, 0, payload.numpy().data)]


async def test_bad_patches_are_refused_and_the_weights_stay(delta_fleet: DeltaFleet) -> None:
    address = delta_fleet.servers[0]
    client = InferenceClient(address, [address], direct=False)
    before = (await client.weight_checksums())[address]
    serving = (await client.weight_versions())[address]
    name, tensor = next(iter(sorted(delta_fleet.original.items())))
    channel = grpc.aio.insecure_channel(address)
    control = control_plane_pb2_grpc.ControlPlaneStub(channel)
    push: Any = channel.stream_unary(PUSH_WEIGHTS, request_serializer=None)

    cases = [
        (_patch_stream(name, tensor, base, indices, values), code, words)
        for base, indices, values, code, words in bad_patches(tensor, serving)
    ] + [
        (
            _patch_stream("model.no_such.weight", tensor, serving, [0], [1.0]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown parameter",
        ),
        (
            _patch_stream(name, tensor, serving, [0, 1], [1.0, 2.0])[:1],  # truncated
            grpc.StatusCode.INVALID_ARGUMENT,
            "truncated push",
        ),
    ]
    for stream, code, words in cases:
        await control.StartWeightUpdate(cp.StartWeightUpdateRequest(weight_version=serving + 1))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await push(iter(stream))
        assert refused.value.code() == code, refused.value.details()
        assert words in (refused.value.details() or ""), refused.value.details()
        await client.cancel_weight_update()
        assert (await client.weight_checksums())[address] == before
    # The next update succeeds.
    version = await next_version(client)
    await client.update_weights(delta_fleet.original.items(), version, delta=False)
    assert (await client.weight_versions())[address] == version
    await channel.close()
    await client.close()


async def test_a_tensor_parallel_server_takes_deltas_and_rolls_back_exactly(
    delta_fleet: DeltaFleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Two workers, each with its shard: the patch is applied in checkpoint coordinates (to the
    # one copy TP rank 0 keeps), the server reports the whole parameters (checksums), and greedy
    # outputs match a TP=1 server serving the same weights.
    from tests.conftest import running_engine_server
    from tests.helpers import reload_fault

    trigger = tmp_path / "break-a-reload"
    monkeypatch.setenv(reload_fault.TRIGGER, str(trigger))
    monkeypatch.syspath_prepend(str(reload_fault.plugin_directory(tmp_path)))
    single = delta_fleet.servers[0]
    async for tp_server in running_engine_server(
        tensor_parallel_size=2, weight_commit_prepare=True
    ):
        both = [single, tp_server.address]
        client = InferenceClient(single, both, direct=False)
        info = (await client.server_info())[tp_server.address]
        # Two workers; one of them (the copy's holder) joins a weight-transfer group.
        assert (info.world_size, info.weight_group_ranks) == (2, 1)
        base = perturbed(delta_fleet.original, seed=41)
        version = await next_version(client)
        await client.update_weights(base.items(), version)
        before = await served_checksums(client)
        stepped = a_training_step(base, seed=42)
        await client.update_weights(stepped.items(), version + 1)
        assert client.last_push_bytes[tp_server.address] < client.last_push_bytes[single] * 1.01
        assert await served_checksums(client) == dict.fromkeys(both, expected_checksums(stepped))
        outputs = await greedy_per_server(both)
        assert outputs[single] == outputs[tp_server.address]
        assert await client.rollback_weights(version + 1) == dict.fromkeys(both, version)
        assert await served_checksums(client) == before
        # Only TP rank 0 keeps the checkpoint copy; rank 1 reloads from it, in shared memory.
        rolled_back = await greedy_per_server(both)
        assert rolled_back[single] == rolled_back[tp_server.address]
        # Compressed patches reach the shards the same way (the first push is whole: the
        # version the client last pushed was rolled back).
        await client.update_weights(base.items(), version + 2)
        compressed = a_training_step(base, seed=43)
        await client.update_weights(compressed.items(), version + 3, compress_patches=True)
        assert await served_checksums(client) == dict.fromkeys(both, expected_checksums(compressed))
        # A reload broken off part-way on rank 1 alone (rank 0 reloaded its shard): a layer
        # prepared as it arrived (both ranks drop it in step: the commit reloads it), then the
        # commit's reload: both ranks restore in step, and the fleet rolls the TP=1 server back.
        reload_fault.arm(trigger, rank=1, during="prepare")
        reload_fault.arm(trigger, rank=1, during="commit")
        with pytest.raises(WeightUpdateError) as raised:
            await client.update_weights(a_training_step(compressed, seed=45).items(), version + 4)
        assert not trigger.exists(), "no reload broke"
        assert reload_fault.MESSAGE in raised.value.outcomes[tp_server.address].what
        assert await served_checksums(client) == dict.fromkeys(both, expected_checksums(compressed))
        outputs = await greedy_per_server(both)
        assert outputs[single] == outputs[tp_server.address]
        await client.close()
        # Over the collective: the broadcasts reach rank 0 alone (a group of the trainer and
        # one worker), and rank 1 reloads what it staged.
        tp = tp_server.address
        broadcaster = InferenceClient(tp, [tp], direct=False)
        assert await broadcaster.init_weight_transfer("gloo", timeout_seconds=60) == {tp: 1}
        await broadcaster.update_weights(compressed.items(), version + 4)  # whole: no base yet
        stepped = a_training_step(compressed, seed=44)
        await broadcaster.update_weights(stepped.items(), version + 5, compress_patches=True)
        assert 0 < broadcaster.last_push_bytes[tp] < 0.1 * delta_fleet.full_bytes
        assert await served_checksums(broadcaster) == {tp: expected_checksums(stepped)}
        await broadcaster.close()


@pytest.fixture(scope="module")
async def broadcasting_client(delta_fleet: DeltaFleet) -> AsyncIterator[InferenceClient]:
    """A client of both servers that formed a gloo group with them (rank 0)."""
    client = InferenceClient(delta_fleet.servers[0], delta_fleet.servers, direct=False)
    await client.init_weight_transfer("gloo", timeout_seconds=60)
    yield client
    await client.close()


async def test_a_delta_over_the_collective_gives_the_same_weights_as_a_full_broadcast(
    delta_fleet: DeltaFleet, broadcasting_client: InferenceClient
) -> None:
    client, servers = broadcasting_client, delta_fleet.servers
    full_bytes = delta_fleet.full_bytes
    first = perturbed(delta_fleet.original, seed=51)
    version = await next_version(client)
    await client.update_weights(first.items(), version, transport="collective")
    assert client.last_push_bytes == dict.fromkeys(servers, full_bytes)  # no base yet

    stepped = a_training_step(first, seed=52)
    await client.update_weights(stepped.items(), version + 1, transport="collective")
    assert all(0 < sent < 0.1 * full_bytes for sent in client.last_push_bytes.values())
    assert await served_checksums(client) == dict.fromkeys(servers, expected_checksums(stepped))
    after_delta = await greedy_per_server(servers)
    await client.update_weights(stepped.items(), version + 2, delta=False)
    assert await greedy_per_server(servers) == after_delta

    # delta=False kept no base: whole again, and a base kept. Then the second server moves on
    # elsewhere: one broadcast reaches both, so both get it all.
    await client.update_weights(stepped.items(), version + 3)
    assert client.last_push_bytes == dict.fromkeys(servers, full_bytes)
    await other_version_moves(servers[1], version + 4)
    moved = a_training_step(stepped, seed=54)
    await client.update_weights(moved.items(), version + 5, transport="collective")
    assert client.last_push_bytes == dict.fromkeys(servers, full_bytes)
    assert await served_checksums(client) == dict.fromkeys(servers, expected_checksums(moved))


async def test_a_dense_step_names_its_changes_with_a_bitmap_in_band_and_over_the_collective(
    delta_fleet: DeltaFleet, broadcasting_client: InferenceClient
) -> None:
    client, servers = broadcasting_client, delta_fleet.servers
    full_bytes = delta_fleet.full_bytes
    weights = perturbed(delta_fleet.original, seed=61)
    version = await next_version(client)
    await client.update_weights(weights.items(), version, transport="grpc")
    transports: tuple[Literal["grpc", "collective"], ...] = ("grpc", "collective")
    for step, transport in enumerate(transports, start=1):
        weights = a_training_step(weights, seed=61 + step, fraction=0.2)
        await client.update_weights(weights.items(), version + step, transport=transport)
        # float32, 20% changed: 4-byte indices and 4-byte values would be 40% of the model's
        # bytes; a bit per element and the values are ~23%.
        sent = client.last_push_bytes
        assert all(0.15 * full_bytes < n < 0.3 * full_bytes for n in sent.values()), sent
        checksums = await served_checksums(client)
        assert checksums == dict.fromkeys(servers, expected_checksums(weights))


async def other_version_moves(address: str, version: int) -> None:
    """Another trainer commits ``version`` on ``address`` with the weights it serves."""
    other = InferenceClient(address, [address], direct=False)
    await other.update_weights([], version)  # the same weights as a new version
    await other.close()


async def test_a_server_that_moved_since_the_client_looked_refuses_the_patch_and_gets_it_all(
    delta_fleet: DeltaFleet, broadcasting_client: InferenceClient, monkeypatch: Any
) -> None:
    client, servers = broadcasting_client, delta_fleet.servers
    full_bytes = delta_fleet.full_bytes
    base = perturbed(delta_fleet.original, seed=61)
    version = await next_version(client)
    await client.update_weights(base.items(), version, transport="collective")
    await other_version_moves(servers[1], version + 1)
    # The client looked before the second server moved: it broadcasts patches, which that
    # server refuses (FAILED_PRECONDITION, nothing staged); the whole weights follow to both.
    from trainer_client.weights import weight_calls
    from trainer_client.weights.update_plan import ServerState

    asked = weight_calls.ServerWeightCalls.state

    async def stale_view(self: Any, address: str) -> ServerState:
        return dataclasses.replace(await asked(self, address), version=version)

    monkeypatch.setattr(weight_calls.ServerWeightCalls, "state", stale_view)
    stepped = a_training_step(base, seed=62)
    await client.update_weights(stepped.items(), version + 2, transport="collective")
    sent = client.last_push_bytes
    assert all(full_bytes < b < 1.1 * full_bytes for b in sent.values()), (sent, full_bytes)
    assert await served_checksums(client) == dict.fromkeys(servers, expected_checksums(stepped))
    assert set((await client.weight_versions()).values()) == {version + 2}


def _patch_bucket(
    name: str, tensor: torch.Tensor, base_version: int, indices: list[int], values: list[float]
) -> list[Any]:
    from trainer_client.weights.weight_sending import plan_buckets

    return plan_buckets([_patch(name, tensor, base_version, indices, values)])


async def on_the_original_weights(
    delta_fleet: DeltaFleet, client: InferenceClient
) -> tuple[dict[str, dict[str, bytes]], int]:
    """Commits the model's original weights as a new version; returns every server's
    checksums of them and that version."""
    version = await next_version(client)
    await client.update_weights(delta_fleet.original.items(), version)
    return await client.weight_checksums(), version


async def refused_by_every_server(
    client: InferenceClient, buckets: list[Any], version: int, code: grpc.StatusCode, words: str
) -> None:
    """Opens an update to ``version`` on every server of ``client``, broadcasts ``buckets`` and
    checks that each server refused them with ``code`` and a message holding ``words``; then
    cancels the update."""
    servers = list(client.config.servers)
    sender = client.weights.local.sender
    assert sender is not None
    for address in servers:
        await client._core.control(address).StartWeightUpdate(
            cp.StartWeightUpdateRequest(weight_version=version)
        )
    failures = await client.weights.delivery.broadcast_buckets(sender, servers, buckets, 60)
    assert set(failures) == set(servers)
    for failure in failures.values():
        assert isinstance(failure, ServerError), failure
        assert failure.code == code and words in failure.details, failure
    await client.cancel_weight_update()


async def test_bad_patches_over_the_collective_are_refused_and_the_weights_stay(
    delta_fleet: DeltaFleet, broadcasting_client: InferenceClient
) -> None:
    client, servers = broadcasting_client, delta_fleet.servers
    before, serving = await on_the_original_weights(delta_fleet, client)
    name, tensor = next(iter(sorted(delta_fleet.original.items())))
    cases = [
        (_patch_bucket(name, tensor, base, indices, values), code, words)
        for base, indices, values, code, words in bad_patches(tensor, serving)
    ]
    for buckets, code, words in cases:
        await refused_by_every_server(client, buckets, serving + 1, code, words)
        assert await client.weight_checksums() == before
    # The next update succeeds, as a patch.
    stepped = a_training_step(delta_fleet.original, seed=71)
    await client.update_weights(stepped.items(), serving + 1)
    assert await served_checksums(client) == dict.fromkeys(servers, expected_checksums(stepped))


async def test_compressed_patches_give_the_same_weights_in_band_and_over_the_collective(
    delta_fleet: DeltaFleet, broadcasting_client: InferenceClient
) -> None:
    client, servers = broadcasting_client, delta_fleet.servers
    weights = perturbed(delta_fleet.original, seed=81)
    version = await next_version(client)
    await client.update_weights(weights.items(), version, transport="grpc")
    steps = [(t, f) for t in ("grpc", "collective") for f in (0.02, 0.1)]  # indices; bitmaps
    for step, (transport, fraction) in enumerate(steps, start=1):
        stepped = a_training_step(weights, seed=81 + step, fraction=fraction)
        plain, sent = await pushed_compressed(client, weights, stepped, version + step, transport)
        assert all(0 < n < 0.8 * plain for n in sent.values()), (sent, plain)
        assert await served_checksums(client) == dict.fromkeys(servers, expected_checksums(stepped))
        weights = stepped


async def pushed_compressed(
    client: InferenceClient,
    base: dict[str, torch.Tensor],
    stepped: dict[str, torch.Tensor],
    version: int,
    transport: str,
) -> tuple[int, dict[str, int]]:
    """Pushes ``stepped`` over ``base`` with compressed patches: the bytes its plain patches
    would have taken, and what went to each server."""
    plain = sum(data.numel() for _, data in weight_patches(stepped.items(), base, 0))
    await client.update_weights(
        stepped.items(),
        version,
        transport=transport,  # type: ignore[arg-type]
        compress_patches=True,
    )
    return plain, dict(client.last_push_bytes)


def _compressed_patch(
    name: str,
    serving: torch.Tensor,
    base_version: int,
    indices: list[int],
    values: list[float],
    changed: int = 0,
) -> tuple[cp.ParameterSpec, torch.Tensor]:
    """A hand-made compressed patch of ``serving`` (the values the server holds), claiming
    ``changed`` elements (0: as many as ``indices``)."""
    from skyrl_grpc import patch_format
    from skyrl_grpc.tensor_bytes import flat_bytes

    spec, payload = _patch(name, serving, base_version, indices, values)
    itemsize = serving.element_size()
    base_values = flat_bytes(serving).numpy().view(f"<u{itemsize}")[indices]
    frame = patch_format.compress(
        payload.numpy(), base_values, serving.numel(), itemsize, len(indices), bitmap=False
    )
    spec.patch.changed = changed or len(indices)
    spec.patch.zstd_bytes = len(frame)
    return spec, torch.frombuffer(bytearray(frame), dtype=torch.uint8)


async def test_bad_compressed_patches_are_refused_and_the_weights_stay(
    delta_fleet: DeltaFleet, broadcasting_client: InferenceClient
) -> None:
    from trainer_client.weights.weight_sending import plan_buckets

    client, servers = broadcasting_client, delta_fleet.servers
    before, serving = await on_the_original_weights(delta_fleet, client)
    name, tensor = next(iter(sorted(delta_fleet.original.items())))
    garbage_spec, _ = _patch(name, tensor, serving, list(range(10)), [1.0] * 10)
    garbage_spec.patch.zstd_bytes = 40
    many = list(range(0, 400, 5))  # enough that a frame is smaller than the patch
    swapped = [*many[:10], many[11], many[10], *many[12:]]
    poisoned = [1.0] * 79 + [float("nan")]
    cases = [
        ((garbage_spec, torch.arange(40, dtype=torch.uint8)), "does not decompress"),
        (_compressed_patch(name, tensor, serving, many, [1.0] * 80, 160), "holds"),
        (_compressed_patch(name, tensor, serving, [0] * 6, [1.0] * 6, 1), "send it uncompressed"),
        (_compressed_patch(name, tensor, serving, swapped, [1.0] * 80), "strictly increasing"),
        (_compressed_patch(name, tensor, serving, many, poisoned), "NaN or an infinity"),
    ]
    address = servers[0]
    channel = grpc.aio.insecure_channel(address)
    push: Any = channel.stream_unary(PUSH_WEIGHTS, request_serializer=None)
    for (spec, frame), words in cases:
        # In-band, to one server.
        await client._core.control(address).StartWeightUpdate(
            cp.StartWeightUpdateRequest(weight_version=serving + 1)
        )
        manifest = cp.PushWeightsRequest(manifest=cp.WeightManifest(parameters=[spec]))
        stream = [manifest.SerializeToString(), encode_chunk(name, 0, frame.numpy().data)]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await push(iter(stream))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in (refused.value.details() or ""), refused.value.details()
        await client.cancel_weight_update()
        # Over the collective, to both.
        buckets = plan_buckets([(spec, frame)])
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        await refused_by_every_server(client, buckets, serving + 1, invalid, words)
        assert await client.weight_checksums() == before
    # The next update succeeds, compressed.
    stepped = a_training_step(delta_fleet.original, seed=91)
    await client.update_weights(stepped.items(), serving + 1, compress_patches=True)
    assert await served_checksums(client) == dict.fromkeys(servers, expected_checksums(stepped))
    await channel.close()


async def test_a_server_that_does_not_take_compressed_patches_gets_them_plain(
    delta_fleet: DeltaFleet, broadcasting_client: InferenceClient, monkeypatch: Any
) -> None:
    from trainer_client.weights import weight_calls
    from trainer_client.weights.update_plan import ServerState

    client, servers = broadcasting_client, delta_fleet.servers
    newer, older = servers
    asked = weight_calls.ServerWeightCalls.state

    async def as_an_older_server(self: Any, address: str) -> ServerState:
        state = await asked(self, address)
        if address == older:  # its GetServerInfo lacks capabilities.compressed_weight_patches
            return dataclasses.replace(state, takes_compressed=False)
        return state

    monkeypatch.setattr(weight_calls.ServerWeightCalls, "state", as_an_older_server)
    weights = perturbed(delta_fleet.original, seed=95)
    version = await next_version(client)
    await client.update_weights(weights.items(), version, transport="grpc")
    transports: tuple[Literal["grpc", "collective"], ...] = ("grpc", "collective")
    for step, transport in enumerate(transports, start=1):
        stepped = a_training_step(weights, seed=95 + step)
        plain, sent = await pushed_compressed(client, weights, stepped, version + step, transport)
        assert sent[older] == plain
        # In-band each server gets its own; one broadcast reaches both: plain to both.
        assert sent[newer] < 0.8 * plain if transport == "grpc" else sent[newer] == plain
        assert await served_checksums(client) == dict.fromkeys(servers, expected_checksums(stepped))
        weights = stepped
