"""Weight-transfer rules without an engine: validation, in-band assembly, ordering."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from servers.engine.domain.weights.transaction import WeightTransferManager
from servers.engine.peers.stream_items import push_item
from servers.engine.service import validate
from servers.engine.service.control_convert import bucket_spec
from servers.engine.transfer import protocol
from servers.engine.transfer.assembly import InBandAssembler, ParamLayout, bucket_layout
from servers.engine.transfer.handoff import HandoffBuffer, HandoffReader
from servers.engine.worker.worker_extension import WeightTransferWorker
from skyrl_grpc import dtypes
from skyrl_grpc.errors import DataLoss, FailedPrecondition, InvalidArgument
from skyrl_grpc.v1 import control_plane_pb2 as cp
from tests.helpers.waits import until
from trainer_client.fleet_info import group_ranks
from trainer_client.weights.weight_sending import (
    plan_buckets,
    push_messages,
    rank_offsets,
    tensor_entries,
)

LAYOUT = {
    "a.weight": ParamLayout(dtypes.BY_TORCH["float32"], (4, 3)),
    "b.bias": ParamLayout(dtypes.BY_TORCH["float32"], (5,)),
}
TENSORS = [
    ("a.weight", torch.arange(12, dtype=torch.float32).reshape(4, 3)),
    ("b.bias", torch.ones(5)),
]


async def push_items(messages: Any) -> Any:
    """PushWeights' messages as the update's ``push`` takes them."""
    async for message in messages:
        yield push_item(message)


def messages(chunk_bytes: int = 16) -> list[cp.PushWeightsRequest]:
    return [cp.PushWeightsRequest.FromString(m) for m in push_messages(TENSORS, chunk_bytes)]


def test_a_complete_push_reassembles_every_tensor() -> None:
    assembler = InBandAssembler(LAYOUT)
    for message in messages():
        assembler.add(push_item(message))
    items = {p["name"]: (p["dtype"], p["shape"], b"".join(p["chunks"])) for p in assembler.finish()}
    for name, tensor in TENSORS:
        dtype, shape, raw = items[name]
        assert dtype == "float32" and shape == list(tensor.shape)
        assert torch.equal(
            torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape), tensor
        )
    assert assembler.bytes_received == (12 + 5) * 4


@pytest.mark.parametrize(
    ("mutate", "error", "fragment"),
    [
        (lambda ms: ms[1:], InvalidArgument, "first PushWeights message must be the manifest"),
        (lambda ms: ms[:-1], InvalidArgument, "truncated push"),
        (lambda ms: [ms[0], ms[2], ms[1], *ms[3:]], InvalidArgument, "must arrive in order"),
        (lambda ms: [ms[0], *ms], InvalidArgument, "second manifest"),
    ],
)
def test_malformed_streams_are_rejected(mutate: Any, error: type[Exception], fragment: str) -> None:
    assembler = InBandAssembler(LAYOUT)
    with pytest.raises(error, match=fragment):
        for message in mutate(messages()):
            assembler.add(push_item(message))
        assembler.finish()


def test_a_corrupted_chunk_is_data_loss() -> None:
    stream = messages()
    data = stream[2].chunk.data
    stream[2].chunk.data = bytes([data[0] ^ 0xFF]) + data[1:]
    assembler = InBandAssembler(LAYOUT)
    with pytest.raises(DataLoss, match=r"checksum mismatch in the chunk of a\.weight"):
        for message in stream:
            assembler.add(push_item(message))


def test_chunks_may_carry_sha256_instead_of_crc32_but_not_neither() -> None:
    stream = messages()
    for message in stream[1:]:
        message.chunk.sha256 = hashlib.sha256(message.chunk.data).digest()
        message.chunk.ClearField("crc32")
    assembler = InBandAssembler(LAYOUT)
    for message in stream:
        assembler.add(push_item(message))
    assert len(assembler.finish()) == len(TENSORS)

    stream = messages()
    stream[1].chunk.ClearField("crc32")
    assembler = InBandAssembler(LAYOUT)
    assembler.add(push_item(stream[0]))
    with pytest.raises(InvalidArgument, match="has no checksum: set crc32"):
        assembler.add(push_item(stream[1]))


def test_a_parameter_whose_bytes_differ_from_its_manifest_sha256_is_data_loss() -> None:
    stream = messages()
    stream[0].manifest.parameters[0].sha256 = hashlib.sha256(b"other bytes").digest()
    assembler = InBandAssembler(LAYOUT)
    # Refused as soon as the parameter is complete, before the rest of the stream.
    with pytest.raises(DataLoss, match=r"checksum mismatch for a\.weight"):
        for message in stream:
            assembler.add(push_item(message))
    assert assembler.bytes_received == 12 * 4


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (
            cp.ParameterSpec(name="nope", dtype=cp.D_TYPE_FLOAT32, shape=[1]),
            "unknown parameter 'nope'",
        ),
        (
            cp.ParameterSpec(name="b.bias", dtype=cp.D_TYPE_FLOAT16, shape=[5]),
            "dtype mismatch for b.bias",
        ),
        (
            cp.ParameterSpec(name="b.bias", dtype=cp.D_TYPE_FLOAT32, shape=[6]),
            "shape mismatch for b.bias",
        ),
        (cp.ParameterSpec(name="b.bias", dtype=99, shape=[5]), "not a supported DType"),  # type: ignore[arg-type]
    ],
)
def test_manifest_entries_must_match_the_model(spec: cp.ParameterSpec, fragment: str) -> None:
    manifest = cp.PushWeightsRequest(manifest=cp.WeightManifest(parameters=[spec]))
    with pytest.raises(InvalidArgument, match=fragment):
        InBandAssembler(LAYOUT).add(push_item(manifest))


def test_large_tensors_are_sent_from_their_own_memory_and_small_ones_packed() -> None:
    big, small = plan_buckets(tensor_entries(TENSORS), bucket_bytes=1 << 20, direct_bytes=48)
    assert big.direct and not small.direct
    assert [p.parameter.name for p in big.layout.parameters] == ["a.weight"]
    assert big.layout.size_bytes == 48 and big.layout.parameters[0].offset_bytes == 0
    assert big.pack().data_ptr() == TENSORS[0][1].data_ptr()  # no copy
    assert torch.equal(small.pack().view(torch.float32), torch.ones(5))
    validated = bucket_layout(bucket_spec(big.layout), LAYOUT)
    assert [p["name"] for p in validated["params"]] == ["a.weight"]


def test_buckets_pack_at_their_offsets_and_overlaps_are_rejected() -> None:
    (bucket,) = plan_buckets(tensor_entries(TENSORS), bucket_bytes=1 << 20)
    assert [p.offset_bytes for p in bucket.layout.parameters] == [0, 48]
    packed = bucket.pack()
    assert torch.equal(packed[48:].view(torch.float32), torch.ones(5))
    assert (
        bucket.layout.parameters[0].parameter.sha256
        == hashlib.sha256(TENSORS[0][1].numpy().tobytes()).digest()
    )
    assert len(plan_buckets(tensor_entries(TENSORS), bucket_bytes=40)) == 2
    validated = bucket_layout(bucket_spec(bucket.layout), LAYOUT)
    assert [p["offset"] for p in validated["params"]] == [0, 48]
    bucket.layout.parameters[1].offset_bytes = 40
    with pytest.raises(InvalidArgument, match="overlap"):
        bucket_layout(bucket_spec(bucket.layout), LAYOUT)
    bucket.layout.parameters[1].offset_bytes = 60
    with pytest.raises(InvalidArgument, match="spans bytes"):
        bucket_layout(bucket_spec(bucket.layout), LAYOUT)


def test_rank_offsets_follow_the_ranks_each_server_takes() -> None:
    assert rank_offsets([1, 1]) == ([1, 2], 3)
    assert rank_offsets([2, 4, 1]) == ([1, 3, 7], 8)
    # A tensor-parallel server takes one rank (its copy's holder joins); one that does not say
    # (older than the field) is taken to join with every worker, as it did.
    assert group_ranks(cp.GetServerInfoResponse(world_size=4, weight_group_ranks=1)) == 1
    assert group_ranks(cp.GetServerInfoResponse(world_size=4)) == 4


# What FakeWorkers records: vLLM's lifecycle calls, and each update payload by its kind.
JOIN_GROUP = "init_weight_transfer_engine"
LEAVE_GROUP = "shutdown_weight_transfer_engine"
START = "start_weight_update"
STAGE = "update_weights: stage"
RECEIVE = "update_weights: receive"
DISCARD = "update_weights: discard"
ROLLBACK = "update_weights: restore_previous"
COMMIT = "finish_weight_update: commit"
CLOSE = "finish_weight_update: close"


class FakeWorkers:
    """One worker: vLLM's weight lifecycle (``protocol.Lifecycle``) and the worker extension's
    methods (``rpc``), answering as an engine whose every update succeeds."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.staged: set[str] = set()
        # The bytes staged for each parameter, put together from their pieces.
        self.values: dict[str, bytes] = {}
        self.report = protocol.empty_report()
        self.handoff = HandoffReader()

    async def __call__(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        self.calls.append(method)
        answers = {
            protocol.LAYOUT: {
                n: {"dtype": p.dtype.torch_name, "shape": list(p.shape)} for n, p in LAYOUT.items()
            },
            protocol.REPORT: self.report,
            protocol.FREE_ROLLBACK: 64,  # the bytes a worker freed
        }
        return [answers.get(method)]

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(JOIN_GROUP)

    async def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append(LEAVE_GROUP)

    async def start_weight_update(self) -> None:
        self.calls.append(START)
        self.staged = set()

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        kind = next(
            k for k in ("stage", "receive", "discard", "restore_previous") if k in update_info
        )
        self.calls.append(f"update_weights: {kind}")
        self.report = protocol.empty_report()
        if kind == "stage":
            if update_info.get("handoff"):  # as the engine does (``transfer_engine._stage``)
                why = self.handoff.why_unreadable(update_info["handoff"])
                if why:
                    self.report["handoff_error"] = why
                    return
            for param in update_info["stage"]:
                self.staged.add(param["name"])
                value = self.values[param["name"]] if param["offset"] else b""  # 0: a new value
                assert len(value) == param["offset"], "pieces must arrive in order"
                region = param.get("region")
                chunks = (
                    [self.handoff.view(update_info["handoff"], region)]
                    if region
                    else param["chunks"]
                )
                self.values[param["name"]] = value + b"".join(chunks)
            self.report["params"] = sum(1 for param in update_info["stage"] if param["last"])
        elif kind == "discard":
            self.report["changed"], self.staged = len(self.staged), set()
        elif kind == "restore_previous":
            self.staged = set(LAYOUT)

    async def finish_weight_update(self, weight_version: str | None) -> None:
        self.calls.append(COMMIT if weight_version is not None else CLOSE)
        self.report = protocol.empty_report()
        self.report["changed"], self.staged = len(self.staged), set()


def calls(workers: FakeWorkers, handoff: HandoffBuffer | None = None) -> protocol.WorkerCalls:
    return protocol.WorkerCalls(workers, workers, handoff)


async def _messages() -> Any:
    for m in messages():
        yield m


async def test_calls_out_of_order_are_failed_precondition() -> None:
    workers = FakeWorkers()
    manager = WeightTransferManager(calls(workers))
    with pytest.raises(FailedPrecondition, match="before InitWeightTransfer"):
        await manager.update([])
    with pytest.raises(FailedPrecondition, match="FinishWeightUpdate before StartWeightUpdate"):
        await manager.finish(1)
    with pytest.raises(FailedPrecondition, match="PushWeights before StartWeightUpdate"):
        await manager.push(push_items(_messages()))
    await manager.start()
    with pytest.raises(FailedPrecondition, match="already open"):
        await manager.start()
    assert await manager.push(push_items(_messages())) == (2, 68)
    with pytest.raises(InvalidArgument, match="StartWeightUpdate named no version"):
        await manager.finish(0)
    with pytest.raises(InvalidArgument, match="not newer than the serving version 0"):
        await manager.finish(-1)
    assert await manager.finish(3) == (3, 2)
    assert manager.version == 3 and COMMIT in workers.calls
    with pytest.raises(InvalidArgument, match="InitWeightTransfer takes GLOO"):
        validate.weight_transfer_group(
            cp.InitWeightTransferRequest(backend=cp.WEIGHT_TRANSFER_BACKEND_GRPC_STREAM)
        )


async def test_a_failed_push_closes_the_update_without_touching_weights() -> None:
    workers = FakeWorkers()
    manager = WeightTransferManager(calls(workers))
    await manager.start()

    async def truncated() -> Any:
        for m in messages()[:-1]:
            yield m

    with pytest.raises(InvalidArgument, match="truncated push; update rejected"):
        await manager.push(push_items(truncated()))
    assert COMMIT not in workers.calls and STAGE not in workers.calls
    assert not manager.update_open
    with pytest.raises(FailedPrecondition):
        await manager.finish(1)


def test_every_protocol_method_is_a_method_of_the_worker_extension() -> None:
    """The server calls workers by these names: a renamed worker method must fail here, not
    inside vLLM at the first weight update."""
    for name in protocol.METHODS:
        assert callable(getattr(WeightTransferWorker, name, None)), name
    assert sorted(protocol.METHODS) == sorted(
        n for n in vars(WeightTransferWorker) if n.startswith("skyrl_")
    )


@pytest.mark.slow  # imports vLLM: about 8 s on 2 cores, out of the quick loop
def test_the_lifecycle_the_server_drives_is_vllms() -> None:
    """``protocol.Lifecycle`` names AsyncLLM's weight-transfer methods: a vLLM that renamed one
    fails here. The engine registered under ``protocol.BACKEND`` is this project's."""
    import inspect

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.v1.engine.async_llm import AsyncLLM

    from servers.engine.worker.transfer_engine import SkyrlWeightTransferEngine
    from servers.engine.worker.vllm_plugin import register

    for name in [n for n in vars(protocol.Lifecycle) if not n.startswith("_")]:
        assert inspect.iscoroutinefunction(getattr(AsyncLLM, name)), name
    register()
    register()  # vLLM may run a plugin more than once
    assert WeightTransferEngineFactory._registry[protocol.BACKEND]() is SkyrlWeightTransferEngine


async def test_leaving_a_group_before_joining_another() -> None:
    workers = FakeWorkers()
    manager = WeightTransferManager(calls(workers))
    spec = validate.weight_transfer_group(
        cp.InitWeightTransferRequest(
            backend=cp.WEIGHT_TRANSFER_BACKEND_GLOO,
            master_address="127.0.0.1",
            master_port=1234,
            rank_offset=1,
            world_size=2,
        )
    )
    await manager.init(spec)
    await manager.init(spec)
    assert workers.calls == [JOIN_GROUP, LEAVE_GROUP, JOIN_GROUP]


def manager_at(version: int, **options: Any) -> tuple[WeightTransferManager, FakeWorkers]:
    workers = FakeWorkers()
    return WeightTransferManager(calls(workers), version=version, **options), workers


async def test_the_target_version_is_checked_before_any_weight_is_sent() -> None:
    manager, workers = manager_at(4)
    for stale in (4, 3):
        with pytest.raises(InvalidArgument, match="not newer than the serving version 4"):
            await manager.start(stale)
    assert not manager.update_open and DISCARD not in workers.calls
    update = await manager.start(4, allow_same_version=True)  # re-pushing version 4
    assert update.target_version == 4
    await manager.cancel()
    await manager.start(5)
    await manager.push(push_items(_messages()))
    with pytest.raises(InvalidArgument, match="opened the update for version 5"):
        await manager.finish(6)
    assert await manager.finish(0) == (5, 2)  # 0: the version Start named
    assert manager.version == 5


async def test_an_open_update_locks_out_other_owners_until_its_lease_expires() -> None:
    manager, workers = manager_at(0)
    await manager.start(1, owner="trainer-a", lease_seconds=0.3)
    with pytest.raises(FailedPrecondition, match="owner trainer-a"):
        await manager.start(1, owner="trainer-b")
    with pytest.raises(FailedPrecondition, match="owner trainer-a"):
        await manager.start(1)  # an anonymous caller cannot take it over either
    restarted = await manager.start(1, owner="trainer-a", lease_seconds=0.3)  # same owner
    assert manager.open is restarted
    # Nobody calls: the lease expires on its own and the staging is dropped.
    discards = workers.calls.count(DISCARD)
    await until(lambda: not manager.update_open, 3, "the lease to expire")
    assert workers.calls.count(DISCARD) == discards + 1
    taken = await manager.start(1, owner="trainer-b")
    assert taken.owner == "trainer-b"
    await manager.close()


async def test_calls_renew_the_lease() -> None:
    manager, _ = manager_at(0)
    # 0.75 s in all, but never the lease's 0.6 s without a call (a margin of 4x the pause
    # between calls, for a busy machine that wakes a sleeper late).
    await manager.start(1, owner="slow", lease_seconds=0.6)
    for _ in range(5):
        await asyncio.sleep(0.15)
        await manager.push(push_items(_messages()))
    assert manager.update_open
    assert await manager.finish() == (1, 2)
    await manager.close()


async def test_a_commit_can_be_rolled_back_until_the_next_update_starts() -> None:
    manager, workers = manager_at(2)
    with pytest.raises(FailedPrecondition, match="nothing to roll back"):
        await manager.rollback(2)
    await manager.start(3)
    await manager.push(push_items(_messages()))
    await manager.finish()
    assert manager.rollback_version == 2
    with pytest.raises(FailedPrecondition, match="is not the serving version 3"):
        await manager.rollback(4)
    assert await manager.rollback(3) == 2
    assert manager.version == 2 and ROLLBACK in workers.calls
    with pytest.raises(FailedPrecondition, match="nothing to roll back"):
        await manager.rollback(2)
    await manager.start(3)
    await manager.push(push_items(_messages()))
    await manager.finish()
    await manager.start(4)  # a new update: the weights before 3 are no longer kept
    assert protocol.RECYCLE_ROLLBACK in workers.calls
    with pytest.raises(FailedPrecondition, match="nothing to roll back"):
        await manager.rollback(3)
    await manager.close()


async def test_the_fleet_commit_releases_the_rollback_copy() -> None:
    manager, workers = manager_at(2)
    await manager.start(3)
    await manager.push(push_items(_messages()))
    await manager.finish()
    with pytest.raises(FailedPrecondition, match="is not the serving version 3"):
        await manager.release_rollback(2)  # a late release for an older commit
    assert manager.rollback_version == 2 and protocol.FREE_ROLLBACK not in workers.calls
    assert await manager.release_rollback(3) == 64
    assert manager.rollback_version is None and protocol.FREE_ROLLBACK in workers.calls
    with pytest.raises(FailedPrecondition, match=r"nothing to roll back.*ReleaseRollback"):
        await manager.rollback(3)
    # While a newer update is open nothing is kept to release: the workers are not asked.
    await manager.start(4)
    calls = len(workers.calls)
    assert await manager.release_rollback(3) == 0 and len(workers.calls) == calls
    assert manager.version == 3
    await manager.close()


def _poisoned(name: str, value: float, chunk_bytes: int = 16) -> list[cp.PushWeightsRequest]:
    tensors = [(n, t.clone()) for n, t in TENSORS]
    dict(tensors)[name].view(-1)[3] = value
    return [cp.PushWeightsRequest.FromString(m) for m in push_messages(tensors, chunk_bytes)]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_parameter(value: float) -> None:
    assembler = InBandAssembler(LAYOUT)
    with pytest.raises(InvalidArgument, match=r"b\.bias holds a NaN or an infinity"):
        for message in _poisoned("b.bias", value):
            assembler.add(push_item(message))
    allowing = InBandAssembler(LAYOUT, allow_non_finite=True)
    for message in _poisoned("b.bias", value):
        allowing.add(push_item(message))
    assert len(allowing.finish()) == 2 and allowing.non_finite == ["b.bias"]


def test_a_value_split_by_a_chunk_boundary_is_still_checked() -> None:
    # 6-byte chunks cut float32 values in two; the poisoned one (bytes 12..15) spans chunks.
    with pytest.raises(InvalidArgument, match=r"a\.weight holds"):
        assembler = InBandAssembler(LAYOUT)
        for message in _poisoned("a.weight", float("nan"), chunk_bytes=6):
            assembler.add(push_item(message))
    assembler = InBandAssembler(LAYOUT)
    for message in messages(chunk_bytes=6):
        assembler.add(push_item(message))
    assert len(assembler.finish()) == 2


async def test_replacing_non_finite_weights_asks_the_engine_to_clear_their_traces() -> None:
    changes: list[bool] = []

    async def changed(replaced_non_finite: bool) -> None:
        changes.append(replaced_non_finite)

    manager = WeightTransferManager(calls(FakeWorkers()), changed, allow_non_finite=True)

    async def push(stream: list[cp.PushWeightsRequest], version: int) -> None:
        async def each() -> Any:
            for m in stream:
                yield m

        await manager.start(version)
        await manager.push(push_items(each()))
        await manager.finish()

    await push(_poisoned("a.weight", float("nan")), 1)  # allowed, recorded
    await push(messages(), 2)  # replaces the poisoned weights
    await push(messages(), 3)
    assert changes == [False, True, False]
    await manager.rollback(3)  # back to 2: finite, replacing finite
    assert changes[-1] is False
    await manager.close()


def test_a_peft_models_own_state_dict_names_map_to_the_saved_adapter_names() -> None:
    from trainer_client.weights.weight_sending import lora_push_messages, peft_tensor_name

    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    assert peft_tensor_name(f"{prefix}.lora_A.default.weight") == f"{prefix}.lora_A.weight"
    assert peft_tensor_name(f"{prefix}.lora_B.weight") == f"{prefix}.lora_B.weight"
    assert peft_tensor_name("model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    import torch

    manifest = lora_push_messages([(f"{prefix}.lora_A.default.weight", torch.zeros(2, 4))])[0]
    assert [p.name for p in manifest.manifest.parameters] == [f"{prefix}.lora_A.weight"]


async def test_bytes_reach_the_workers_as_they_arrive_not_after_the_stream() -> None:
    # A batch smaller than one chunk: each chunk goes on to the workers once it arrived, while
    # the rest of the stream (and of its parameter) is still coming: the server never holds
    # the stream or a parameter whole, and the workers put the pieces together exactly.
    workers = FakeWorkers()
    manager = WeightTransferManager(calls(workers), stage_batch_bytes=8)
    await manager.start()
    stages_seen_mid_stream = []

    async def watched() -> Any:
        sent = messages()
        for index, message in enumerate(sent):
            if index == len(sent) - 1:
                stages_seen_mid_stream.append(workers.calls.count(STAGE))
            yield message

    assert await manager.push(push_items(watched())) == (2, 68)
    # a.weight's three chunks and b.bias's first went on before b.bias's last chunk came (the
    # last of them may still be on its way: one batch is staged while the next arrives)
    assert stages_seen_mid_stream[0] >= 3
    assert workers.calls.count(STAGE) == 5
    assert workers.values == {n: t.numpy().tobytes() for n, t in TENSORS}

    # A stream cut after a parameter was staged: the staged part is discarded, nothing commits.
    await manager.cancel()
    await manager.start()

    async def cut() -> Any:
        for message in messages()[:-1]:
            yield message

    with pytest.raises(InvalidArgument, match="truncated push"):
        await manager.push(push_items(cut()))
    assert DISCARD in workers.calls and COMMIT not in workers.calls
    assert not manager.update_open


def test_the_assembler_hands_over_what_arrived_in_pieces_and_keeps_no_reference() -> None:
    assembler = InBandAssembler(LAYOUT)
    sent = messages()  # b.bias (20 bytes) in two chunks: 16 + 4
    for message in sent[:-1]:
        assembler.add(push_item(message))
    early = assembler.take_ready()
    assert [(p["name"], p["offset"], p["last"]) for p in early] == [
        ("a.weight", 0, True),
        ("b.bias", 0, False),  # a large parameter need not be complete to go on
    ]
    assert assembler.take_ready() == [] and assembler.ready_bytes == 0  # handed over once
    assembler.add(push_item(sent[-1]))
    rest = assembler.finish()
    assert [(p["name"], p["offset"], p["last"]) for p in rest] == [("b.bias", 16, True)]
    assert sum(len(c) for c in rest[0]["chunks"]) == 4


async def test_a_session_an_engine_error_left_open_is_closed_before_the_next_update() -> None:
    """vLLM's worker keeps its update session open when a finish raised; the next update must
    not fail on it forever: what it staged is dropped, it is closed and a new one opens."""

    class StaleOnce(FakeWorkers):
        stale = True

        async def start_weight_update(self) -> None:
            if self.stale:
                self.stale = False
                raise RuntimeError(
                    "start_weight_update called while a weight update is already active. "
                    "Call finish_weight_update first."
                )
            await super().start_weight_update()

    workers = StaleOnce()
    manager = WeightTransferManager(calls(workers))
    await manager.start(1)
    lifecycle = [c for c in workers.calls if c != protocol.REPORT]  # without report reads
    assert lifecycle[-3:] == [DISCARD, CLOSE, START] and manager.update_open
    await manager.push(push_items(_messages()))
    assert await manager.finish() == (1, 2)


def test_bitmap_patches_must_name_exactly_the_changed_elements_inside_the_parameter() -> None:
    import numpy as np

    from servers.engine.transfer.assembly import check_patch
    from skyrl_grpc import patch_format
    from skyrl_grpc.errors import InvalidArgument

    bitmap = patch_format.bitmap_of(np.array([0, 5, 9]), 10)  # 10 elements: 2 bytes
    check_patch("w", 10, bitmap.tobytes(), 3, bitmap=True)
    with pytest.raises(InvalidArgument, match="names 3 elements, the manifest says 4"):
        check_patch("w", 10, bitmap.tobytes(), 4, bitmap=True)
    past_the_end = bitmap.copy()
    past_the_end[1] |= 1 << 7  # element 15 of a 10-element parameter
    with pytest.raises(InvalidArgument, match="past the last of 10"):
        check_patch("w", 10, past_the_end.tobytes(), 4, bitmap=True)


async def recorded_push(
    handoff: HandoffBuffer,
    stage_batch_bytes: int | None = None,
    before_call: Any = None,
) -> tuple[FakeWorkers, list[dict[str, Any]]]:
    """Pushes ``_messages()`` through a manager whose workers record every ``update_weights``
    (``before_call(update_info)`` first, when given); returns the workers and the calls."""
    workers = FakeWorkers()
    extra: dict[str, Any] = {}
    if stage_batch_bytes is not None:
        extra["stage_batch_bytes"] = stage_batch_bytes
    manager = WeightTransferManager(calls(workers, handoff), **extra)
    await manager.start()
    sent: list[dict[str, Any]] = []
    record = workers.update_weights

    async def recording(update_info: dict[str, Any]) -> None:
        sent.append(update_info)
        if before_call is not None:
            before_call(update_info)
        await record(update_info)

    workers.update_weights = recording  # type: ignore[method-assign]
    assert await manager.push(push_items(_messages())) == (2, 68)
    assert workers.values == {n: t.numpy().tobytes() for n, t in TENSORS}
    assert await manager.finish(1) == (1, 2)
    return workers, sent


async def test_in_band_bytes_reach_the_workers_through_shared_memory(tmp_path: Any) -> None:
    # The server copies each batch into its buffer; the call carries only where each piece
    # lies, and the workers read the same bytes from there. The file's name goes once the
    # workers have it mapped: a server killed later leaves nothing behind.
    handoff = HandoffBuffer(64, directory=str(tmp_path))
    _, sent = await recorded_push(handoff, stage_batch_bytes=16)
    staged = [p for info in sent for p in info["stage"]]
    assert staged and all(p["chunks"] == [] and p["region"] for p in staged)
    assert {info["handoff"] for info in sent} == {handoff.path}
    assert list(tmp_path.iterdir()) == []
    handoff.close()


async def test_a_batch_larger_than_the_shared_buffer_goes_inline(tmp_path: Any) -> None:
    workers = FakeWorkers()
    handoff = HandoffBuffer(8, directory=str(tmp_path))  # smaller than any batch
    manager = WeightTransferManager(calls(workers, handoff))
    await manager.start()
    assert await manager.push(push_items(_messages())) == (2, 68)
    assert workers.values == {n: t.numpy().tobytes() for n, t in TENSORS}
    handoff.close()
    assert list(tmp_path.iterdir()) == []  # removed when the server closes it


async def test_workers_that_cannot_map_the_shared_buffer_get_the_bytes_inline(
    tmp_path: Any,
) -> None:
    # A worker on another host (or in a container with a /dev/shm of its own) does not see the
    # server's file: it stages nothing and says why; the server sends that batch again inline,
    # removes its file and sends every later batch inline. Nothing is lost.
    handoff = HandoffBuffer(64, directory=str(tmp_path))

    def elsewhere(update_info: dict[str, Any]) -> None:
        if update_info.get("handoff"):
            os.unlink(update_info["handoff"])  # this worker's /dev/shm has no such file

    _, sent = await recorded_push(handoff, stage_batch_bytes=16, before_call=elsewhere)
    assert [bool(info.get("handoff")) for info in sent][:2] == [True, False]
    assert not any(info.get("handoff") for info in sent[1:])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("buffer_bytes", "expected_calls"),
    [
        (50, [[True], [True]]),  # a.weight's 48 bytes fill it: b.bias follows in a second call
        (40, [[False], [True]]),  # a.weight is larger than the whole buffer: inline, alone
    ],
)
async def test_what_overflows_the_shared_buffer_follows_in_the_next_call(
    tmp_path: Any, buffer_bytes: int, expected_calls: list[list[bool]]
) -> None:
    # The buffer holds a batch and the chunk that overshoots it; what does not fit (a large
    # patch completing a batch) follows through the buffer in another call, in order, and
    # only a piece larger than the whole buffer goes inline.
    handoff = HandoffBuffer(buffer_bytes, directory=str(tmp_path))
    _, sent = await recorded_push(handoff)
    staged = [info for info in sent if "stage" in info]
    assert [[bool(p.get("region")) for p in info["stage"]] for info in staged] == expected_calls
    handoff.close()


def test_a_shared_buffer_places_pieces_while_they_fit(tmp_path: Any) -> None:
    buffer = HandoffBuffer(6, directory=str(tmp_path))
    assert buffer.place([[b"ab", b"c"], [b"de"], [b"fg"], [b"h"]]) == [[0, 3], [3, 2]]
    assert buffer.read([3, 2]) == b"de"
    buffer.close()


def test_a_shared_buffer_the_system_cannot_give_leaves_bytes_inline(tmp_path: Any) -> None:
    assert HandoffBuffer(64, directory=str(tmp_path / "missing")).place([[b"abc"]]) is None


def test_a_shared_buffer_is_made_at_first_use_and_one_a_dead_server_left_is_removed(
    tmp_path: Any,
) -> None:
    import subprocess
    import sys

    from servers.engine.transfer.handoff import PREFIX

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    abandoned = tmp_path / f"{PREFIX}{dead.stdout.strip()}-x"
    abandoned.write_bytes(b"left by a killed server")
    buffer = HandoffBuffer(64, directory=str(tmp_path))
    assert abandoned.exists()  # nothing made or removed before the first in-band update
    assert buffer.place([[b"abc"], [b"de"]]) == [[0, 3], [3, 2]]
    assert [p.name for p in tmp_path.iterdir()] == [Path(buffer.path).name]
    assert bytes(HandoffReader().view(buffer.path, [3, 2])) == b"de"
    buffer.mapped()
    assert list(tmp_path.iterdir()) == []
    buffer.close()


async def test_a_worker_failing_while_the_next_batch_arrives_rejects_the_push() -> None:
    # One batch is staged while the next is received: its failure still ends the push, the
    # staging is discarded and nothing commits.
    workers = FakeWorkers()
    manager = WeightTransferManager(calls(workers), stage_batch_bytes=8)
    await manager.start()
    stage = workers.update_weights

    async def failing_second(update_info: dict[str, Any]) -> None:
        if workers.calls.count(STAGE) == 1 and "stage" in update_info:
            raise RuntimeError("worker died")
        await stage(update_info)

    workers.update_weights = failing_second  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="worker died"):
        await manager.push(push_items(_messages()))
    # vLLM's worker ended its session when the call raised: nothing left to discard
    assert COMMIT not in workers.calls and not manager.update_open
    with pytest.raises(FailedPrecondition):
        await manager.finish(1)


def one_tensor_messages(index: int, chunk_bytes: int = 16) -> list[cp.PushWeightsRequest]:
    raw = push_messages(TENSORS[index : index + 1], chunk_bytes)
    return [cp.PushWeightsRequest.FromString(m) for m in raw]


async def test_streams_of_one_update_are_staged_side_by_side() -> None:
    """A server in two relay trees takes a stream from each parent at once: neither waits for
    the other to end (here each stream waits, mid-way, for the other to have begun: staged
    one after the other they would never end), and both land."""
    workers = FakeWorkers()
    manager = WeightTransferManager(calls(workers), stage_batch_bytes=8)
    await manager.start()
    begun = [asyncio.Event(), asyncio.Event()]

    async def stream(index: int) -> Any:
        sent = one_tensor_messages(index)
        for position, message in enumerate(sent):
            if position == 1:
                begun[index].set()
                await begun[1 - index].wait()
            yield message

    both = asyncio.gather(*(manager.push(push_items(stream(i))) for i in (0, 1)))
    assert await asyncio.wait_for(both, timeout=30) == [(1, 48), (1, 20)]
    assert workers.values == {n: t.numpy().tobytes() for n, t in TENSORS}
    assert await manager.finish(1) == (1, 2)


async def test_a_stream_may_carry_several_manifests_each_after_the_last_ones_chunks() -> None:
    workers = FakeWorkers()
    manager = WeightTransferManager(calls(workers))
    await manager.start()

    async def groups() -> Any:
        for message in [*one_tensor_messages(0), *one_tensor_messages(1)]:
            yield message

    assert await manager.push(push_items(groups())) == (2, 68)
    assert workers.values == {n: t.numpy().tobytes() for n, t in TENSORS}

    async def early() -> Any:  # the second manifest before the first one's last chunk
        first, second = one_tensor_messages(0), one_tensor_messages(1)
        for message in [*first[:-1], *second]:
            yield message

    with pytest.raises(InvalidArgument, match=r"before a\.weight was complete"):
        await manager.push(push_items(early()))
    assert not manager.update_open  # rejected whole: nothing of it commits


async def test_one_parameter_in_two_streams_at_once_and_a_commit_mid_stream_are_refused() -> None:
    workers = FakeWorkers()
    manager = WeightTransferManager(calls(workers))
    await manager.start()
    arrived, release = asyncio.Event(), asyncio.Event()

    async def held() -> Any:
        sent = one_tensor_messages(0)
        yield sent[0]
        arrived.set()
        await release.wait()
        for message in sent[1:]:
            yield message

    first = asyncio.ensure_future(manager.push(push_items(held())))
    await arrived.wait()
    with pytest.raises(FailedPrecondition, match="still arriving"):
        await manager.finish(1)

    async def again() -> Any:
        for message in one_tensor_messages(0):
            yield message

    with pytest.raises(InvalidArgument, match="already arriving in another stream"):
        await manager.push(push_items(again()))
    release.set()
    with pytest.raises(FailedPrecondition):  # the refusal rejected the update it belonged to
        await first
    assert not manager.update_open and COMMIT not in workers.calls


async def test_a_stream_of_an_update_cancelled_under_it_stages_nothing_after_the_discard() -> None:
    workers = FakeWorkers()
    manager = WeightTransferManager(calls(workers), stage_batch_bytes=8)
    await manager.start()
    arrived, release = asyncio.Event(), asyncio.Event()

    async def slow() -> Any:
        sent = messages()
        for position, message in enumerate(sent):
            if position == 2:
                arrived.set()
                await release.wait()
            yield message

    pushing = asyncio.ensure_future(manager.push(push_items(slow())))
    await arrived.wait()
    await manager.cancel()
    release.set()
    with pytest.raises(FailedPrecondition, match="closed while this stream was staging"):
        await pushing
    assert STAGE not in workers.calls[workers.calls.index(DISCARD) :]
