"""vLLM's requests read as this stack's (``vllm_control_convert``, ``vllm_inference_convert``):
the buckets of its weight-transfer JSON are exactly the broadcasts vLLM's own trainer makes (its
``pack_tensors``), and bad JSON or counts out of this stack's range are refused
INVALID_ARGUMENT naming the key, never an internal error."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
import torch

from servers.engine.service import vllm_control_convert as convert
from servers.engine.service import vllm_inference_convert as inference_convert
from skyrl_grpc.errors import InvalidArgument, Unimplemented
from skyrl_grpc.vllm_api import inference_pb2 as vi

INIT = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}


def tensors() -> dict[str, torch.Tensor]:
    return {
        "a": torch.zeros(100, dtype=torch.float32),  # 400 bytes
        "b": torch.zeros(30, dtype=torch.bfloat16),  # 60
        "c": torch.zeros(10, 10, dtype=torch.float16),  # 200
        "d": torch.zeros(500, dtype=torch.int8),  # 500
        "e": torch.zeros(3, dtype=torch.float64),  # 24
    }


def update_info(weights: dict[str, torch.Tensor]) -> bytes:
    return json.dumps(
        {
            "names": list(weights),
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
            "shapes": [list(t.shape) for t in weights.values()],
        }
    ).encode()


@pytest.mark.parametrize("buffer_bytes", [1, 300, 450, 700, 10_000])
def test_packed_buckets_are_the_broadcasts_vllms_pack_tensors_makes(buffer_bytes: int) -> None:
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    weights = tensors()
    items, chunks = iter(weights.items()), []
    # vLLM warns of each tensor larger than the buffer ("d" is the largest, 500 bytes).
    with pytest.warns(UserWarning) if buffer_bytes < 500 else contextlib.nullcontext():
        while (chunk := pack_tensors(items, lambda item: item[1], buffer_bytes)) is not None:
            chunks.append(chunk)
    packing = convert.Packing(packed=True, buffer_bytes=buffer_bytes)
    request = convert.update_weights(update_info(weights), packing)
    assert [[p.parameter.name for p in b.parameters] for b in request.buckets] == [
        c.names for c in chunks
    ]
    assert [b.size_bytes for b in request.buckets] == [c.packed_tensor.numel() for c in chunks]
    for bucket, chunk in zip(request.buckets, chunks, strict=True):
        offsets = [sum(chunk.tensor_sizes[:i]) for i in range(len(chunk.names))]
        assert [p.offset_bytes for p in bucket.parameters] == offsets


def test_unpacked_is_one_bucket_per_tensor() -> None:
    weights = tensors()
    request = convert.update_weights(update_info(weights), convert.Packing(packed=False))
    assert [len(b.parameters) for b in request.buckets] == [1] * len(weights)
    assert [b.size_bytes for b in request.buckets] == [
        t.numel() * t.element_size() for t in weights.values()
    ]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"master_port": -1}, "master_port = -1"),
        ({"master_port": "29500"}, "master_port must be a JSON int"),
        ({"world_size": True}, "world_size must be a JSON int"),
        ({"group_name": 7}, "group_name must be a JSON str"),
        ({"timeout_seconds": "soon"}, "timeout_seconds must be a JSON int"),
        ({"packed": "yes"}, "packed must be a JSON bool"),
        ({"packed_buffer_size_bytes": -5}, "packed_buffer_size_bytes = -5"),
        ({"backend": "mpi"}, "gloo or nccl"),
        ({"extra": 1}, "unknown keys ['extra']"),
    ],
)
def test_bad_init_info_is_refused_naming_the_key(change: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        convert.init_weight_transfer(json.dumps(INIT | change).encode(), "gloo")
    assert words in str(refused.value)


def test_a_unique_id_rendezvous_is_unimplemented_saying_what_to_send() -> None:
    with pytest.raises(Unimplemented) as refused:
        convert.init_weight_transfer(
            json.dumps(INIT | {"nccl_unique_id_b64": "x"}).encode(), "gloo"
        )
    assert "master_address and master_port" in str(refused.value)


@pytest.mark.parametrize(
    ("info", "words"),
    [
        ({"names": [7], "dtype_names": ["float32"], "shapes": [[1]]}, "non-empty string"),
        ({"names": ["w"], "dtype_names": ["complex64"], "shapes": [[1]]}, "complex64"),
        ({"names": ["w"], "dtype_names": ["float32"], "shapes": [[-1]]}, "not a list of sizes"),
        (
            {"names": ["w"], "dtype_names": ["float32"], "shapes": [[1 << 30, 1 << 30]]},
            "no parameter's",
        ),
        ({"names": ["w"], "dtype_names": [], "shapes": [[1]]}, "one entry per tensor"),
        ({"names": "w", "dtype_names": [], "shapes": []}, "names must be a JSON list"),
    ],
)
def test_bad_update_info_is_refused_naming_the_tensor(info: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        convert.update_weights(json.dumps(info).encode(), convert.Packing())
    assert words in str(refused.value)


@pytest.mark.parametrize(
    ("request_fields", "words"),
    [
        ({"sampling": vi.RandomSampling(top_k=1 << 31)}, "sampling.top_k"),
        ({"stopping": vi.StoppingCriteria(max_new_tokens=(1 << 32) - 1)}, "max_new_tokens"),
        ({"stopping": vi.StoppingCriteria(min_new_tokens=1 << 31)}, "min_new_tokens"),
        (
            {
                "response": vi.ResponseOptions(
                    output_logprobs=True, output_candidates=vi.CandidateTokens(top_n=1 << 31)
                )
            },
            "output_candidates.top_n",
        ),
    ],
)
def test_counts_beyond_this_stacks_range_are_refused_naming_the_field(
    request_fields: dict[str, Any], words: str
) -> None:
    request = vi.GenerateRequest(token_ids=vi.TokenIds(ids=[1, 2]), **request_fields)
    with pytest.raises(InvalidArgument) as refused:
        inference_convert.sampling_params(request)
    assert words in str(refused.value)
