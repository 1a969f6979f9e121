"""The trainer client's parts on their own, no engine: errors per status, typed settings,
plain results read from the servers' answers, and the control plane's fan-out against
stand-in control servers (the subject here is the client, not the server)."""

from __future__ import annotations

import asyncio
import dataclasses
import typing
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from servers.common.listener import bind, server_options
from skyrl_grpc.errors import TRANSPORT_BROKE, server_lost
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc, lora_pb2
from trainer_client import (
    DEFAULT,
    BlockingInferenceClient,
    ClientConfig,
    ClientSettings,
    FanOutError,
    InferenceClient,
    InvalidArgument,
    NotFound,
    PauseMode,
    ServerError,
    ServerInfo,
    ServerLoad,
    Unavailable,
)


def test_each_status_raises_its_own_subclass_of_server_error() -> None:
    for code, kind in [
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
    ]:
        error = ServerError.of("a:1", code, "why")
        assert type(error) is kind and isinstance(error, ServerError)
        assert error.code == code and str(error) == f"a:1: {code.name}: why"
    # A status without a subclass of its own is a plain ServerError.
    assert type(ServerError.of("a:1", grpc.StatusCode.DATA_LOSS, "crc")) is ServerError


def test_a_connection_broken_under_a_call_is_a_lost_server_not_a_server_error() -> None:
    def failed(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    # grpc's client core's own report of a broken transport: the server was lost.
    broken = ServerError.from_rpc_error("a:1", failed(grpc.StatusCode.INTERNAL, TRANSPORT_BROKE))
    assert type(broken) is Unavailable and "connection broke" in broken.details
    assert server_lost(failed(grpc.StatusCode.INTERNAL, TRANSPORT_BROKE))
    # A server's own INTERNAL is its answer.
    bug = ServerError.from_rpc_error("a:1", failed(grpc.StatusCode.INTERNAL, "a bug"))
    assert not isinstance(bug, Unavailable) and bug.code == grpc.StatusCode.INTERNAL
    assert not server_lost(failed(grpc.StatusCode.INTERNAL, "a bug"))
    assert server_lost(failed(grpc.StatusCode.UNAVAILABLE, "Socket closed"))


def test_constructor_settings_are_exactly_the_configs_fields() -> None:
    fields = {f.name for f in dataclasses.fields(ClientConfig)} - {"router", "servers"}
    assert set(typing.get_type_hints(ClientSettings)) == fields
    client = InferenceClient("r:1", ["s:1"], token="t", direct=False, control_timeout=3)
    assert client.config == ClientConfig(
        "r:1", ("s:1",), token="t", direct=False, control_timeout=3
    )


def test_server_info_reads_as_plain_values() -> None:
    info = ServerInfo.from_proto(
        cp.GetServerInfoResponse(
            world_size=2,
            weight_version=7,
            capabilities=cp.Capabilities(
                pause_modes=[cp.PAUSE_MODE_ABORT, cp.PAUSE_MODE_KEEP],
                weight_transfer_backends=[cp.WEIGHT_TRANSFER_BACKEND_GRPC_STREAM],
                lora=lora_pb2.LoraCapabilities(enabled=True, max_lora_rank=16),
            ),
            open_weight_update=cp.OpenWeightUpdate(owner="trainer", weight_version=8),
        )
    )
    assert (info.world_size, info.weight_version) == (2, 7)
    assert info.capabilities.pause_modes == (PauseMode.ABORT, PauseMode.KEEP)
    assert info.capabilities.weight_transfer_backends == ("grpc_stream",)
    assert info.capabilities.lora.enabled and info.capabilities.lora.max_lora_rank == 16
    assert info.open_weight_update is not None and info.open_weight_update.weight_version == 8
    assert info.rollback_weight_version is None
    assert ServerInfo.from_proto(cp.GetServerInfoResponse()).open_weight_update is None


async def test_bad_arguments_are_refused_before_any_call() -> None:
    client = InferenceClient("127.0.0.1:1", [])
    with pytest.raises(ValueError, match="use one of abort, wait, keep"):
        await client.pause("freeze")
    # Without a group, the default transport is the one that needs no setup: the update gets
    # as far as asking for servers (none here), not "no collective group".
    with pytest.raises(ValueError, match="no server addresses"):
        await client.update_weights([("w", b"")], 1)
    with pytest.raises(ValueError, match="no collective group"):
        await client.update_weights([("w", b"")], 1, transport="collective")


class _StandInControlPlane(control_plane_pb2_grpc.ControlPlaneServicer):
    """Records pauses and reports a load; ``refuse`` makes every call fail NOT_FOUND."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.pauses: list[int] = []
        # The deadline each call left the server (None: the caller set none).
        self.time_remaining: list[float | None] = []

    async def _check(self, context: Any) -> None:
        if self.refuse:
            await context.abort(grpc.StatusCode.NOT_FOUND, "nothing here")

    async def Pause(self, request, context):  # type: ignore[no-untyped-def]
        await self._check(context)
        self.pauses.append(request.mode)
        self.time_remaining.append(context.time_remaining())
        return cp.PauseResponse()

    async def GetLoad(self, request, context):  # type: ignore[no-untyped-def]
        await self._check(context)
        return cp.GetLoadResponse(running_requests=3, kv_cache_usage=0.5)


@pytest.fixture
async def stand_in_servers() -> AsyncIterator[list[tuple[str, _StandInControlPlane]]]:
    servers, started = [], []
    for refuse in (False, False, True):
        servicer = _StandInControlPlane(refuse)  # type: ignore[abstract]  # the calls it needs
        server = grpc.aio.server(options=server_options())
        control_plane_pb2_grpc.add_ControlPlaneServicer_to_server(servicer, server)
        address = f"127.0.0.1:{bind(server, '127.0.0.1:0', None)}"
        await server.start()
        started.append(server)
        servers.append((address, servicer))
    yield servers
    for server in started:
        await server.stop(0)


async def test_control_calls_fan_out_with_typed_results(
    stand_in_servers: list[tuple[str, _StandInControlPlane]],
) -> None:
    (a, first), (b, second), (c, _) = stand_in_servers
    client = InferenceClient(a, [a, b], direct=False)
    assert await client.pause(PauseMode.KEEP) == [a, b]
    assert first.pauses == second.pauses == [cp.PAUSE_MODE_KEEP]
    loads = await client.server_loads()
    assert loads == {x: ServerLoad(3, 0, 0.5, False) for x in (a, b)}
    # One server refusing: FanOutError names it, as its status's error, with the others' results.
    with_refusing = InferenceClient(a, [a, b, c], direct=False)
    with pytest.raises(FanOutError) as raised:
        await with_refusing.server_loads(timeout=5)
    assert set(raised.value.failures) == {c} and isinstance(raised.value.failures[c], NotFound)
    assert raised.value.results[a] == ServerLoad(3, 0, 0.5, False)
    assert "GetLoad failed on 1 of 3 servers" in str(raised.value)
    await client.close()
    await with_refusing.close()


async def test_a_timeout_of_none_sets_no_deadline_and_default_the_clients(
    stand_in_servers: list[tuple[str, _StandInControlPlane]],
) -> None:
    (a, servicer), _, _ = stand_in_servers
    client = InferenceClient(a, [a], direct=False, control_timeout=30)
    blocking = BlockingInferenceClient(a, [a], direct=False, control_timeout=30)
    await client.pause()  # DEFAULT: ClientConfig.control_timeout
    await client.pause(timeout=None)  # none at all
    await client.pause(timeout=DEFAULT)
    await client.fleet.pause(timeout=5)  # the part itself, as the client forwards to it
    await asyncio.to_thread(blocking.pause, timeout=None)  # the blocking twin passes it on
    first, none, default, five, blocking_none = servicer.time_remaining
    # (gRPC rounds a deadline on the wire: a little over the seconds given.)
    assert first is not None and default is not None and 25 < first < 31 and 25 < default < 31
    assert none is None and blocking_none is None
    assert five is not None and 0 < five < 6
    await client.close()
    blocking.close()


def test_patches_carry_exactly_what_changed_and_a_dense_change_goes_whole() -> None:
    import torch

    from trainer_client.weights.delta_patches import weight_patches

    base = {n: torch.randn(64, 64, dtype=torch.bfloat16) for n in ("sparse", "dense", "same")}
    new = {n: t.clone() for n, t in base.items()}
    new["sparse"].view(-1)[[3, 700, 4000]] += 1.0
    new["dense"] += 1.0  # every element: compared on a sample only, and sent whole
    entries = {spec.name: (spec, data) for spec, data in weight_patches(new.items(), base, 7)}
    assert set(entries) == {"sparse", "dense"}  # nothing where nothing changed
    spec, data = entries["sparse"]
    assert (spec.patch.base_weight_version, spec.patch.changed) == (7, 3)
    assert data[:12].view(torch.int32).tolist() == [3, 700, 4000]
    assert torch.equal(data[12:].view(torch.bfloat16), new["sparse"].view(-1)[[3, 700, 4000]])
    spec, data = entries["dense"]
    assert not spec.HasField("patch")
    assert torch.equal(data.view(torch.bfloat16).view(64, 64), new["dense"])


def test_a_patch_names_many_changes_with_a_bitmap_and_applies_to_the_same_bits() -> None:
    import numpy as np
    import torch

    from skyrl_grpc import patch_format
    from trainer_client.weights.delta_patches import (
        _device_patch_of,
        _host_patch_of,
        weight_patches,
    )

    generator = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(123, 45, generator=generator).to(torch.bfloat16)}
    new = {"w": base["w"].clone()}
    changed = torch.rand(base["w"].shape, generator=generator) < 0.1  # an lr-1e-5-like step
    new["w"][changed] += 1.0
    ((spec, data),) = weight_patches(new.items(), base, 7)
    count, elements = int(changed.sum()), base["w"].numel()
    assert spec.patch.changed == count and spec.patch.bitmap  # 1 bit each beats 4-byte indices
    assert data.numel() == (elements + 7) // 8 + 2 * count  # under half the tensor's bytes
    assert data.numel() < (4 + 2) * count  # smaller than with indices
    # Read back as the server does: the same bits as the new tensor, exactly.
    raw = data.numpy()
    indices = patch_format.changed_indices(raw, elements, count, bitmap=True)
    assert indices.tolist() == changed.view(-1).nonzero().view(-1).tolist()
    values = raw[patch_format.names_bytes(elements, count, True) :].view(np.int16)
    patched = base["w"].view(-1).view(torch.int16).numpy().copy()
    patched[indices] = values
    assert np.array_equal(patched, new["w"].view(-1).view(torch.int16).numpy())
    # The device path (run on the CPU here) writes the same bitmap.
    new_bits, old_bits = new["w"].view(-1).view(torch.int16), base["w"].view(-1).view(torch.int16)
    host = _host_patch_of(new_bits, old_bits, 2, limit=1e9)
    device = _device_patch_of(new_bits, old_bits, 2, limit=1e9)
    assert torch.equal(host[1], device[1]) and torch.equal(host[1], data)


@pytest.mark.parametrize("fraction", [0.005, 0.1])  # indices; a bitmap
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_compressed_patch_is_smaller_and_decompresses_to_the_same_bits(
    fraction: float, dtype: str
) -> None:
    import numpy as np
    import torch

    from skyrl_grpc import patch_format
    from skyrl_grpc.tensor_bytes import flat_bytes
    from trainer_client.weights.delta_patches import weight_patches

    generator = torch.Generator().manual_seed(11)
    torch_dtype = getattr(torch, dtype)
    master = 0.02 * torch.randn(300, 1000, generator=generator)
    base = {"w": master.to(torch_dtype)}
    # An optimizer step: small moves of some weights, which keep their sign and exponent.
    moved = torch.rand(master.shape, generator=generator) < fraction
    new = {"w": torch.where(moved, master * 1.01, master).to(torch_dtype)}
    ((plain_spec, plain),) = weight_patches(new.items(), base, 4)
    ((spec, frame),) = weight_patches(new.items(), base, 4, compress=True)
    # bf16 ~0.2-0.4 of the patch; float32 less (the XORs' two low bytes are noise).
    assert spec.patch.zstd_bytes == frame.numel() < 0.8 * plain.numel()
    assert spec.patch.changed == plain_spec.patch.changed
    assert spec.patch.bitmap == plain_spec.patch.bitmap == (fraction > 0.05)
    # Read back as the server does: the same names; values XOR the base's give the new bits.
    elements, itemsize, changed = master.numel(), base["w"].element_size(), spec.patch.changed
    bitmap = spec.patch.bitmap
    raw = patch_format.decompress(frame.numpy(), elements, itemsize, changed, bitmap)
    start = patch_format.names_bytes(elements, changed, bitmap)
    assert np.array_equal(raw[:start], plain.numpy()[:start])
    bits = f"<u{itemsize}"
    indices = patch_format.changed_indices(raw, elements, changed, bitmap)
    old = flat_bytes(base["w"]).numpy().view(bits)
    assert np.array_equal(raw[start:].view(bits) ^ old[indices], plain.numpy()[start:].view(bits))
    # A frame that is not one, or holds another patch, says so.
    with pytest.raises(ValueError, match="does not decompress"):
        patch_format.decompress(frame.numpy()[:-9], elements, itemsize, changed, bitmap)
    with pytest.raises(ValueError, match="holds"):
        patch_format.decompress(frame.numpy(), elements, itemsize, changed - 1, bitmap)


def test_patches_that_compress_badly_go_uncompressed() -> None:
    import torch

    from trainer_client.weights.delta_patches import weight_patches

    generator = torch.Generator().manual_seed(12)
    base = {"w": torch.randn(64, 64, generator=generator)}
    new = {"w": base["w"].clone()}
    # Three new values: a zstd frame's own header outweighs what it could save.
    new["w"].view(-1)[[5, 900, 3000]] = torch.randn(3, generator=generator)
    ((spec, data),) = weight_patches(new.items(), base, 4, compress=True)
    assert spec.patch.changed == 3 and spec.patch.zstd_bytes == 0
    assert data.numel() == 3 * 8


def test_patches_found_on_the_host_and_on_a_device_are_the_same_bytes() -> None:
    import torch

    from trainer_client.weights.delta_patches import (
        HOST_BLOCK_ELEMENTS,
        _device_patch_of,
        _host_patch_of,
    )

    # Longer than the host path's comparison block: changes in the first, second and last.
    size = HOST_BLOCK_ELEMENTS * 2 + 5
    old = torch.randint(-(2**15), 2**15, (size,), dtype=torch.int16)
    new = old.clone()
    new[[0, 17, HOST_BLOCK_ELEMENTS, HOST_BLOCK_ELEMENTS + 3, size - 1]] += 1
    host = _host_patch_of(new, old, 2, limit=1e9)
    device = _device_patch_of(new, old, 2, limit=1e9)  # the GPU path, run on the CPU here
    assert host[0] == device[0] == 5
    assert torch.equal(host[1], device[1])
    assert _host_patch_of(new, old, 2, limit=10)[1] is _device_patch_of(new, old, 2, 10)[1] is None
    assert _host_patch_of(old, old, 2, limit=1e9) == (0, None, None)
    # Many changes (a bitmap names them): dense blocks, a sparse one, an untouched one.
    generator = torch.Generator().manual_seed(5)
    dense = torch.rand(size, generator=generator) < 0.1
    dense[HOST_BLOCK_ELEMENTS : 2 * HOST_BLOCK_ELEMENTS] = False
    dense[HOST_BLOCK_ELEMENTS + 9] = True
    dense[2 * HOST_BLOCK_ELEMENTS :] = False
    new = torch.where(dense, old + 1, old)
    host = _host_patch_of(new, old, 2, limit=1e9)
    device = _device_patch_of(new, old, 2, limit=1e9)
    assert host[0] == device[0] == int(dense.sum())
    assert host[1].numel() == (size + 7) // 8 + 2 * host[0]  # a bitmap, then the values
    assert torch.equal(host[1], device[1])
