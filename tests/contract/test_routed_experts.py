"""Routed experts (routing replay, "R3") as the contract carries them: packed in the fewest
bytes that hold the ids (or each token's experts in a layer as one set's rank, in the fewest
bits), with their shape; taken from vLLM's own output types with a MoE
model's real shapes (this CPU build of vLLM cannot capture them: the refusal is tested with the
engine), each step's rows joined through the stream's merges and into the sample, and handed
to the trainer as the array vLLM gave."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from servers.engine.service.data_convert import StreamConverter, build_sampling_params
from skyrl_grpc.routed_experts import concatenate, pack, unpack
from skyrl_grpc.sample_assembly import ResponseAssembler
from skyrl_grpc.stream_chunks import merge_backlog
from skyrl_grpc.v1 import data_plane_pb2, generation_pb2
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


def _top_k(tokens: int, experts: int, per_token: int = PER_TOKEN, seed: int = 0) -> np.ndarray:
    """What a router's top-k gives: ``per_token`` distinct ids per token and layer, in the
    order of their (random) gate weights."""
    rng = np.random.default_rng(seed)
    weights = rng.random((tokens, LAYERS, experts))
    return np.argsort(-weights, axis=2)[:, :, :per_token]


@pytest.mark.parametrize(
    ("experts", "bits", "width"), [(128, 8, 1), (256, 8, 1), (257, 16, 2), (70_000, 32, 4)]
)
def test_ids_travel_in_the_fewest_bytes_that_hold_them_and_come_back_equal(
    experts: int, bits: int, width: int
) -> None:
    array = _experts(10, experts)
    array[0, 0, 0] = experts - 1  # the largest id is there
    packed = pack(array)
    assert (packed.bits, packed.width, packed.as_sets) == (bits, width, False)
    assert (packed.tokens, packed.layers, packed.per_token) == array.shape
    assert len(packed.ids) == (array.size * bits + 7) // 8  # nothing but the ids
    back = unpack(packed)
    assert back.shape == array.shape and np.array_equal(back, array)


def test_whole_bytes_read_the_same_by_their_width_alone() -> None:
    """At 8, 16 and 32 bits the packing is little-endian bytes, which ``width`` describes for
    a reader of the byte packing (the contract's first form)."""
    for experts, kind in ((256, np.uint8), (65_536, np.uint16)):
        array = _experts(4, experts)
        array[0, 0, 0] = experts - 1
        packed = pack(array)
        assert packed.ids == array.astype(np.dtype(kind).newbyteorder("<")).tobytes()
        packed.bits = 0  # as a message of the byte packing arrives
        assert np.array_equal(unpack(packed), array)


@pytest.mark.parametrize(
    ("experts", "per_token", "bits"),
    # Qwen3-30B-A3B, gpt-oss, DeepSeek-V3, Kimi K2, the embedded MoE (4 experts, top-2)
    [(128, 8, 41), (128, 4, 24), (256, 8, 49), (384, 8, 54), (4, 2, 3)],
)
def test_as_sets_each_tokens_experts_are_one_rank_and_come_back_as_the_same_sets(
    experts: int, per_token: int, bits: int
) -> None:
    array = _top_k(9, experts, per_token)
    array[0, 0, :] = np.arange(experts - per_token, experts)  # the largest set: the top rank
    array[0, 1, :] = np.arange(per_token)  # the smallest: rank 0
    packed = pack(array, as_sets=True)
    assert (packed.as_sets, packed.experts, packed.bits) == (True, experts, bits)
    assert len(packed.ids) == (9 * LAYERS * bits + 7) // 8
    back = unpack(packed)
    # the same experts for every token and layer, each set in ascending order
    assert back.shape == array.shape and np.array_equal(back, np.sort(array, axis=2))


@pytest.mark.parametrize("bits", [1, 3, 7, 9, 13, 17, 31, 33, 41, 49, 54, 63, 64])
def test_values_packed_in_any_width_from_1_to_64_bits_come_back(bits: int) -> None:
    """The bit packing under set ranks, at widths that straddle 64-bit words every way, for
    counts that end mid-word and mid-byte."""
    from skyrl_grpc.routed_experts import _pack_bits, _unpack_bits

    rng = np.random.default_rng(bits)
    for count in (0, 1, 2, 3, 7, 64, 1000):
        values = rng.integers(0, 2 ** min(bits, 63), size=count, dtype=np.uint64)
        if bits == 64 and count:
            values[0] = np.uint64(2**64 - 1)  # the top bit too
        packed = _pack_bits(values, bits)
        assert len(packed) == (count * bits + 7) // 8
        assert np.array_equal(_unpack_bits(packed, count, bits).astype(np.uint64), values)


def test_arrays_whose_sets_do_not_fit_are_packed_in_order() -> None:
    repeated = _top_k(3, 128)
    repeated[1, 2, 1] = repeated[1, 2, 0]  # not a set: an id twice
    too_many = _top_k(3, 512, per_token=10)  # C(512, 10) is beyond 64 bits
    for array in (repeated, too_many):
        packed = pack(array, as_sets=True)
        assert not packed.as_sets and np.array_equal(unpack(packed), array)


def test_on_the_wire_they_take_the_packed_ids_and_under_vllms_base64_npy() -> None:
    """vLLM's own servers send the same array as base64 of its .npy bytes (numpy2base64), in
    the capture's dtype (uint8 up to 256 experts, else uint16): a third more than its bytes,
    and the .npy header. Ordered here, a byte an id for 128 experts; as sets, a rank of 41
    bits for each token's 8 (Qwen3-30B-A3B's shape)."""
    from vllm.utils.serial_utils import numpy2base64

    tokens = len(PROMPT) + len(OUTPUT) - 1
    array = _top_k(tokens, EXPERTS).astype(np.uint8)  # vLLM's own dtype here
    theirs = len(numpy2base64(array))
    for as_sets, bits_per_id, at_most in ((False, 8, 0.76), (True, 41 / 8, 0.5)):
        message = generation_pb2.RoutedExperts()
        message.CopyFrom(pack(array, as_sets=as_sets))
        wire = len(message.SerializeToString())
        print(f"as sets {as_sets}: {wire} bytes on the wire; vLLM's base64 .npy: {theirs}")
        assert wire <= 1.1 * array.size * bits_per_id / 8  # the packed values and the shape
        assert wire <= at_most * theirs
    # and, ordered, the same ids vLLM's own encoding decodes to
    npy = base64.b64decode(numpy2base64(array))
    assert npy.endswith(array.tobytes()) and np.array_equal(unpack(pack(array)), array)


def test_unpacking_refuses_what_does_not_match_its_shape() -> None:
    for packed in (pack(_experts(3)), pack(_top_k(3, EXPERTS), as_sets=True)):
        packed.ids = packed.ids[:-1]
        with pytest.raises(ValueError, match="bytes, want"):
            unpack(packed)
    beyond = pack(_top_k(1, 16, per_token=2), as_sets=True)  # ranks below C(16, 2) = 120
    beyond.ids = _rank_bytes(120, beyond.bits, beyond.layers)
    with pytest.raises(ValueError, match="a rank beyond C\\(16, 2\\)"):
        unpack(beyond)
    with pytest.raises(ValueError, match="want \\[tokens, layers, top-k\\]"):
        pack(np.zeros((3, 4), dtype=np.int32))


def _rank_bytes(rank: int, bits: int, count: int) -> bytes:
    """``count`` copies of ``rank`` packed in ``bits`` bits each, least significant bit first."""
    whole = sum(rank << (bits * i) for i in range(count))
    return whole.to_bytes((count * bits + 7) // 8, "little")


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


def _converted(asked: bool, experts: np.ndarray | None, as_sets: bool = False) -> list[object]:
    sampling = generation_pb2.SamplingParams(
        max_tokens=len(OUTPUT),
        return_routed_experts=asked,
        routed_experts_prompt_start=2,
        routed_experts_as_sets=as_sets,
    )
    params = build_sampling_params(sampling, n=1, max_tokens=len(OUTPUT), detokenize=False)
    assert params.routed_experts_prompt_start == (2 if asked else 0)
    converter = StreamConverter(
        "r", PROMPT, params, False, routed_experts=asked, routed_experts_as_sets=as_sets
    )
    chunks = [chunk for output in _outputs(experts) for chunk in converter.chunks(output, 3)]
    for chunk in chunks:
        converter.sendable(chunk)  # as the server sends each message (``RequestMessages``)
    return list(chunks)


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


@pytest.mark.parametrize("as_sets", [False, True])
def test_steps_rows_join_into_the_samples_array_in_merges_and_in_the_sample(as_sets: bool) -> None:
    """Each step's message carries its own rows (the vLLM adapter hands them over per step),
    packed in its own width: ids below 256 in one step and above in the next, sets of a few
    experts and of many. A slow reader's merged backlog and the sample join them in order."""
    steps = [_top_k(4, 200, seed=1), _top_k(1, 300, seed=2), _top_k(2, 40, seed=3)]
    chunks = []
    for index, rows in enumerate(steps):
        chunk = data_plane_pb2.GenerateStreamResponse(token_ids=[index + 1])
        chunk.routed_experts.CopyFrom(pack(rows, as_sets=as_sets))
        chunks.append(chunk)
    whole = np.concatenate(steps)
    want = np.sort(whole, axis=2) if as_sets else whole
    (merged,) = merge_backlog([copy_of(c) for c in chunks])
    assert list(merged.token_ids) == [1, 2, 3]
    assert np.array_equal(unpack(merged.routed_experts), want)
    assembler = ResponseAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    (sample,) = assembler.samples()
    assert np.array_equal(unpack(sample.routed_experts), want)
    with pytest.raises(ValueError, match="cannot be joined"):
        concatenate(pack(steps[0]), pack(_top_k(1, 200, per_token=3)))


def copy_of(chunk: data_plane_pb2.GenerateStreamResponse) -> data_plane_pb2.GenerateStreamResponse:
    copied = data_plane_pb2.GenerateStreamResponse()
    copied.CopyFrom(chunk)
    return copied


def test_n_samples_each_carry_their_own_experts_aligned_with_their_tokens() -> None:
    """With n > 1 vLLM finishes each sample with its own array (the prompt's rows and that
    sample's outputs but the last); each reaches its own sample, in a merged backlog too."""
    from vllm.outputs import CompletionOutput, RequestOutput

    lengths = {0: 6, 1: 3}  # sample 1 stops early: fewer rows
    arrays = {i: _top_k(len(PROMPT) + n - 1, EXPERTS, seed=i) for i, n in lengths.items()}
    sampling = generation_pb2.SamplingParams(max_tokens=6, return_routed_experts=True)
    params = build_sampling_params(sampling, n=2, max_tokens=6, detokenize=False)
    converter = StreamConverter("r", PROMPT, params, False, routed_experts=True)

    def step(first: bool) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=i,
                text="",
                token_ids=OUTPUT[:n] if first else [],
                cumulative_logprob=None,
                logprobs=None,
                routed_experts=None if first else arrays[i],
                finish_reason=None if first else "length",
            )
            for i, n in lengths.items()
        ]
        return RequestOutput("r", None, PROMPT, None, outputs, finished=not first)

    chunks = [c for output in (step(True), step(False)) for c in converter.chunks(output, 1)]
    assembler = ResponseAssembler()
    for chunk in merge_backlog(chunks):
        assembler.add(chunk)
    for index, sample in enumerate(assembler.samples()):
        result = GenerationResult.from_sample(PROMPT, sample, with_logprobs=False)
        assert len(result.token_ids) == lengths[index]
        assert result.routed_experts.shape[0] == len(PROMPT) + lengths[index] - 1
        assert np.array_equal(result.routed_experts, arrays[index])


def test_a_request_asking_for_sets_gets_each_tokens_experts_in_ascending_order() -> None:
    experts = _top_k(len(PROMPT) - 2 + len(OUTPUT) - 1, EXPERTS)
    (*_, last) = _converted(True, experts, as_sets=True)
    assert last.routed_experts.as_sets  # type: ignore[attr-defined]
    assembler = ResponseAssembler()
    assembler.add(last)  # type: ignore[arg-type]
    (sample,) = assembler.samples()
    result = GenerationResult.from_sample(PROMPT, sample, with_logprobs=False)
    assert np.array_equal(result.routed_experts, np.sort(experts, axis=2))


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
