"""Routed experts (routing replay, "R3") as the contract carries them: packed in the fewest
bytes that hold the ids, with their shape; taken from vLLM's own output types with a MoE
model's real shapes (this CPU build of vLLM cannot capture them: the refusal is tested with the
engine), kept whole through the stream's merges, folded into the sample and handed to the
trainer as the array vLLM gave."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from servers.engine.service.data_convert import StreamConverter, build_sampling_params
from skyrl_grpc.routed_experts import pack, unpack
from skyrl_grpc.sample_assembly import ResponseAssembler
from skyrl_grpc.stream_chunks import merge_backlog
from skyrl_grpc.v1 import generation_pb2
from trainer_client.results import GenerationResult

# Qwen3-30B-A3B's shape: 48 MoE layers, 8 of 128 experts per token; a 5-token prompt, 6 output
# tokens (the last has no routing yet).
LAYERS, PER_TOKEN, EXPERTS = 48, 8, 128
PROMPT = [1, 17, 33, 95, 200]
OUTPUT = [7, 8, 9, 10, 11, 12]


def _experts(tokens: int, experts: int = EXPERTS, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # vLLM's capture: the narrowest integer type that holds the ids (uint8 for 128 experts)
    return rng.integers(0, experts, size=(tokens, LAYERS, PER_TOKEN)).astype(np.int32)


@pytest.mark.parametrize(("experts", "width"), [(128, 1), (256, 1), (257, 2), (70_000, 4)])
def test_ids_travel_in_the_fewest_bytes_that_hold_them_and_come_back_equal(
    experts: int, width: int
) -> None:
    array = _experts(10, experts)
    array[0, 0, 0] = experts - 1  # the largest id is there
    packed = pack(array)
    assert packed.width == width
    assert (packed.tokens, packed.layers, packed.per_token) == array.shape
    assert len(packed.ids) == array.size * width  # nothing but the ids
    back = unpack(packed)
    assert back.shape == array.shape and np.array_equal(back, array)


def test_on_the_wire_they_take_the_packed_ids_and_three_quarters_of_vllms_base64_npy() -> None:
    """vLLM's own servers send the same array as base64 of its .npy bytes (numpy2base64), in
    the capture's dtype (uint8 up to 256 experts, else uint16): the same bytes per id as here,
    plus a third for base64 and the .npy header."""
    from vllm.utils.serial_utils import numpy2base64

    array = _experts(len(PROMPT) + len(OUTPUT) - 1).astype(np.uint8)  # vLLM's own dtype here
    message = generation_pb2.RoutedExperts()
    message.CopyFrom(pack(array))
    wire = len(message.SerializeToString())
    theirs = len(numpy2base64(array))
    print(f"routed experts on the wire: {wire} bytes; vLLM's base64 .npy: {theirs} bytes")
    assert wire <= 1.1 * array.size  # the packed ids and a few bytes of shape
    assert wire <= 0.76 * theirs
    # and the same ids vLLM's own encoding decodes to
    npy = base64.b64decode(numpy2base64(array))
    assert npy.endswith(array.tobytes()) and np.array_equal(unpack(message), array)


def test_unpacking_refuses_what_does_not_match_its_shape() -> None:
    packed = pack(_experts(3))
    packed.ids = packed.ids[:-1]
    with pytest.raises(ValueError, match="bytes, want"):
        unpack(packed)
    with pytest.raises(ValueError, match="want \\[tokens, layers, top-k\\]"):
        pack(np.zeros((3, 4), dtype=np.int32))


def _outputs(experts: np.ndarray | None) -> list[object]:
    """vLLM's deltas for one greedy sample: two steps, the last carrying the routed experts
    (vLLM concatenates them on the sample's finish)."""
    from vllm.outputs import CompletionOutput, RequestOutput

    first = CompletionOutput(index=0, text="", token_ids=OUTPUT[:4], cumulative_logprob=None,
                             logprobs=None)  # fmt: skip
    last = CompletionOutput(index=0, text="", token_ids=OUTPUT[4:], cumulative_logprob=None,
                            logprobs=None, routed_experts=experts, finish_reason="length")  # fmt: skip
    return [
        RequestOutput("r", None, PROMPT, None, [first], finished=False),
        RequestOutput("r", None, PROMPT, None, [last], finished=True),
    ]


def _converted(asked: bool, experts: np.ndarray | None) -> list[object]:
    sampling = generation_pb2.SamplingParams(
        max_tokens=len(OUTPUT), return_routed_experts=asked, routed_experts_prompt_start=2
    )
    params = build_sampling_params(sampling, n=1, max_tokens=len(OUTPUT), detokenize=False)
    assert params.routed_experts_prompt_start == (2 if asked else 0)
    converter = StreamConverter("r", PROMPT, params, False, routed_experts=asked)
    return [chunk for output in _outputs(experts) for chunk in converter.chunks(output, 3)]


def test_the_samples_last_message_carries_them_and_the_trainer_gets_vllms_array() -> None:
    experts = _experts(len(PROMPT) - 2 + len(OUTPUT) - 1)  # the prompt from index 2
    chunks = _converted(True, experts)
    assert [c.HasField("routed_experts") for c in chunks] == [False, True]  # type: ignore[attr-defined]
    # Merged with what a slow reader had not taken yet, the last message keeps them whole.
    (merged,) = merge_backlog(chunks)  # type: ignore[arg-type]
    assert list(merged.token_ids) == OUTPUT and merged.HasField("routed_experts")
    assembler = ResponseAssembler()
    assembler.add(merged)
    (sample,) = assembler.samples()
    result = GenerationResult.from_sample(PROMPT, sample, with_logprobs=False)
    assert result.routed_experts is not None
    assert result.routed_experts.shape == (len(PROMPT) - 2 + len(OUTPUT) - 1, LAYERS, PER_TOKEN)
    assert np.array_equal(result.routed_experts, experts)


def test_a_request_that_did_not_ask_gets_none_though_vllm_captured_them() -> None:
    chunks = _converted(False, _experts(len(PROMPT) + len(OUTPUT) - 1))
    assert not any(c.HasField("routed_experts") for c in chunks)  # type: ignore[attr-defined]
    assembler = ResponseAssembler()
    for chunk in chunks:
        assembler.add(chunk)  # type: ignore[arg-type]
    (sample,) = assembler.samples()
    assert GenerationResult.from_sample(PROMPT, sample, False).routed_experts is None


def test_the_openai_edge_encodes_them_exactly_as_vllms_own_server() -> None:
    """``npy_base64`` (what the edge writes in a choice's ``routed_experts``) is vLLM's
    ``numpy2base64`` of the same array, byte for byte, for each width an id takes; a width of
    four bytes is vLLM's int32, read back with the same values."""
    from vllm.utils.serial_utils import numpy2base64

    from skyrl_grpc.routed_experts import npy_base64

    rng = np.random.default_rng(11)
    for kind, largest in ((np.uint8, 127), (np.uint16, 511)):
        array = rng.integers(0, largest + 1, size=(7, 4, 2), dtype=kind)
        assert npy_base64(pack(array)) == numpy2base64(array)
    wide = rng.integers(0, 70_000, size=(3, 2, 2), dtype=np.int32)
    decoded = np.load(io.BytesIO(base64.b64decode(npy_base64(pack(wide)))))
    assert np.array_equal(decoded, wide)
