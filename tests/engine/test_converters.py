"""Validation (``servers.engine.service.validate``) and conversion (``servers.engine.service.data_convert``) rules,
without an engine."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import pytest

from servers.engine.service import validate
from servers.engine.service.data_convert import (
    ChunkCoalescer,
    build_sampling_params,
    finish_to_proto,
    logprobs_to_proto,
)
from servers.engine.service.validate import ModelLimits
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.sample_assembly import ResponseAssembler
from skyrl_grpc.v1 import data_plane_pb2, generation_pb2

LIMITS = ModelLimits(vocab_size=100, max_model_len=64, max_logprobs=5)
SP = generation_pb2.SamplingParams


# Building vLLM's own SamplingParams imports vLLM: about 8 s on 2 cores, out of the quick loop.
IMPORTS_VLLM = pytest.mark.slow


def build(params: generation_pb2.SamplingParams, prompt_len: int = 4, n: int = 1):  # type: ignore[no-untyped-def]
    max_tokens = validate.sampling(params, prompt_len=prompt_len, limits=LIMITS)
    return build_sampling_params(params, n=n, max_tokens=max_tokens, detokenize=False)


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        ([], "is empty"),
        ([1, 2, 100], "prompt_token_ids[2] = 100 is outside the vocabulary"),
        (list(range(64)), "the model's context is 64 tokens"),
    ],
)
def test_bad_prompts_are_rejected_with_a_reason(prompt: list[int], fragment: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        validate.prompt(prompt, LIMITS, "prompt_token_ids")
    assert fragment in str(raised.value)


def test_a_prompt_that_fits_passes() -> None:
    assert validate.prompt([0, 99, 5], LIMITS, "prompt_token_ids") == [0, 99, 5]


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (SP(max_tokens=0), "max_tokens = 0: must be >= 1"),
        (SP(max_tokens=-3), "max_tokens = -3"),
        (SP(max_tokens=61), "use max_tokens <= 60"),
        (SP(temperature=-0.5), "temperature = -0.5: must be >= 0"),
        (SP(top_p=0.0), "top_p = 0.0 is outside (0.0, 1.0]"),
        (SP(top_p=1.5), "top_p = 1.5 is outside"),
        (SP(top_k=-2), "top_k = -2"),
        (SP(min_p=2.0), "min_p = 2.0 is outside"),
        (SP(logprobs=6), "logprobs = 6: must be in 0..5"),
        (SP(prompt_logprobs=-1), "prompt_logprobs = -1"),
        (SP(presence_penalty=3.0), "presence_penalty = 3.0 is outside"),
        (SP(repetition_penalty=0.0), "repetition_penalty = 0.0 is outside"),
        (SP(stop_token_ids=[100]), "stop_token_ids[0] = 100 is outside the vocabulary"),
        (SP(stop_strings=[""]), "empty string"),
        (SP(min_tokens=10, max_tokens=5), "min_tokens = 10"),
    ],
)
def test_bad_sampling_params_name_the_field(
    params: generation_pb2.SamplingParams, fragment: str
) -> None:
    with pytest.raises(InvalidArgument) as raised:
        build(params)
    assert fragment in str(raised.value)


def test_n_zero_means_one_and_negative_is_rejected() -> None:
    assert validate.sample_count(0, LIMITS) == 1
    assert validate.sample_count(4, LIMITS) == 4
    with pytest.raises(InvalidArgument, match="n = -1"):
        validate.sample_count(-1, LIMITS)


def test_server_limits_name_their_flag() -> None:
    limits = ModelLimits(
        vocab_size=100,
        max_model_len=64,
        max_logprobs=5,
        max_prompt_tokens=10,
        max_n=8,
        max_request_id_bytes=16,
    )
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: validate.sample_count(9, limits), "at most 8 (--max-n)"),
        (lambda: validate.prompt_length(11, limits), "at most 10 (--max-prompt-tokens)"),
        (lambda: validate.request_id("x" * 17, limits), "at most 16 (--max-request-id-bytes)"),
        (lambda: validate.request_id("é" * 9, limits), "18 bytes"),
        (lambda: validate.text_length("y" * 500, limits, 4, "prompt"), "--max-prompt-tokens"),
        (
            lambda: validate.sampling(SP(logprobs=6), prompt_len=3, limits=limits),
            "0..5 (--max-logprobs)",
        ),
    ]
    for check, fragment in cases:
        with pytest.raises(InvalidArgument, match=re.escape(fragment)):
            check()
    validate.text_length("y" * 40, limits, 4, "prompt")  # 40 bytes can fit 10 tokens
    assert ModelLimits(vocab_size=100, max_model_len=64, max_logprobs=5).max_prompt_tokens == 63


@IMPORTS_VLLM
def test_unset_fields_take_documented_defaults() -> None:
    params = build(SP(), prompt_len=10)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k in (0, -1)
    assert params.max_tokens == 54  # all the context leaves room for
    assert params.logprobs is None and params.prompt_logprobs is None
    assert params.detokenize is False


@IMPORTS_VLLM
def test_set_fields_reach_vllm() -> None:
    params = build(
        SP(
            temperature=0.0,
            top_k=-1,
            max_tokens=7,
            seed=11,
            stop_token_ids=[3],
            stop_strings=["x"],
            logprobs=2,
            ignore_eos=True,
        )
    )
    assert (params.temperature, params.max_tokens, params.seed) == (0.0, 7, 11)
    assert params.stop_token_ids == [3] and params.stop == ["x"] and params.logprobs == 2
    assert params.top_k in (0, -1) and params.ignore_eos
    assert params.detokenize is True  # stop strings are matched on text


def test_unknown_pause_mode_is_rejected() -> None:
    assert validate.pause_mode(0) == "abort"
    assert validate.pause_mode(3) == "keep"
    with pytest.raises(InvalidArgument, match="mode = 9"):
        validate.pause_mode(9)


@dataclass
class Entry:
    logprob: float
    rank: int | None


def test_logprobs_keep_sampled_token_and_rank_ordered_alternatives() -> None:
    positions = [
        {5: Entry(-0.1, 1), 7: Entry(-2.0, 2), 9: Entry(-3.0, 3)},
        {8: Entry(-4.0, 9), 1: Entry(-0.5, 1), 2: Entry(-1.0, 2)},
    ]
    result = logprobs_to_proto([5, 8], positions, top_k=2)
    assert list(result.token_logprobs) == pytest.approx([-0.1, -4.0])
    assert [list(t.token_ids) for t in result.top_logprobs] == [[5, 7], [1, 2]]
    prompt = logprobs_to_proto([3, 5], [None, positions[0]], top_k=0)
    assert list(prompt.token_logprobs) == pytest.approx([0.0, -0.1])
    assert len(prompt.top_logprobs) == 0


@dataclass
class Flat:
    """vLLM's FlatLogprobs layout: per position a run of entries, the sampled token first."""

    start_indices: list[int]
    end_indices: list[int]
    token_ids: list[int]
    logprobs: list[float]


def test_flat_logprobs_give_the_k_most_likely_with_the_sampled_token_when_it_ranks() -> None:
    # Position 0: the sampled 5 is the most likely, listed once (vLLM does not repeat it).
    # Position 1: the sampled 8 ranks below the top 2, which follow it.
    flat = Flat([0, 2, 5], [2, 5, 5], [5, 7, 8, 1, 2], [-0.1, -2.0, -4.0, -0.5, -1.0])
    result = logprobs_to_proto([5, 8, 3], cast(Any, flat), top_k=2)  # as vLLM's FlatLogprobs
    assert list(result.token_logprobs) == pytest.approx([-0.1, -4.0, 0.0])
    assert [list(t.token_ids) for t in result.top_logprobs] == [[5, 7], [1, 2], []]


def test_finish_reasons_and_stop_matches() -> None:
    assert finish_to_proto(None, None, [1]) == (generation_pb2.FINISH_REASON_UNSPECIFIED, None)
    reason, stop = finish_to_proto("stop", None, [4, 2])
    assert reason == generation_pb2.FINISH_REASON_STOP and stop is not None and stop.token_id == 2
    reason, stop = finish_to_proto("stop", "END", [4])
    assert stop is not None and stop.text == "END"
    assert finish_to_proto("abort", None, [])[0] == generation_pb2.FINISH_REASON_ABORTED
    assert finish_to_proto("length", None, [1])[0] == generation_pb2.FINISH_REASON_LENGTH


def test_assembler_joins_chunks_and_splits_weight_version_spans() -> None:
    chunk = data_plane_pb2.GenerateStreamResponse
    assembler = ResponseAssembler()
    assembler.add(chunk(request_id="r", sample_index=1, token_ids=[9], weight_version=0, text="a"))
    assembler.add(chunk(request_id="r", sample_index=0, token_ids=[1, 2], weight_version=0))
    assembler.add(chunk(request_id="r", sample_index=0, token_ids=[3], weight_version=0))
    assembler.add(
        chunk(
            request_id="r",
            sample_index=0,
            token_ids=[4, 5],
            weight_version=2,
            finish_reason=generation_pb2.FINISH_REASON_LENGTH,
        )
    )
    assembler.add(
        chunk(
            request_id="r",
            sample_index=1,
            token_ids=[],
            weight_version=2,
            text="b",
            finish_reason=generation_pb2.FINISH_REASON_ABORTED,
        )
    )
    first, second = assembler.samples()
    assert list(first.token_ids) == [1, 2, 3, 4, 5]
    assert [(s.weight_version, s.start, s.length) for s in first.weight_versions] == [
        (0, 0, 3),
        (2, 3, 2),
    ]
    assert first.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert list(second.token_ids) == [9] and second.text == "ab"
    assert second.finish_reason == generation_pb2.FINISH_REASON_ABORTED


def _chunk(
    tokens: list[int], version: int = 1, sample: int = 0, **fields: object
) -> data_plane_pb2.GenerateStreamResponse:
    return data_plane_pb2.GenerateStreamResponse(
        request_id="r",
        sample_index=sample,
        token_ids=tokens,
        weight_version=version,
        logprobs=generation_pb2.Logprobs(token_logprobs=[-0.5] * len(tokens)),
        text="".join(f"<{t}>" for t in tokens),
        usage=generation_pb2.Usage(prompt_tokens=3, completion_tokens=tokens[-1] if tokens else 0),
        **fields,  # type: ignore[arg-type]
    )


def test_coalescer_sends_first_token_then_every_interval_then_the_end() -> None:
    coalescer = ChunkCoalescer(4)
    sent = []
    for token in range(1, 11):
        finish = generation_pb2.FINISH_REASON_LENGTH if token == 10 else 0
        sent += coalescer.push(_chunk([token], finish_reason=finish))
    assert [list(c.token_ids) for c in sent] == [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10]]
    merged = sent[1]
    assert list(merged.logprobs.token_logprobs) == [-0.5] * 4
    assert merged.text == "<2><3><4><5>"
    assert merged.usage.completion_tokens == 5  # cumulative usage: the newest wins
    assert sent[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH


def test_coalescer_never_mixes_weight_versions_or_samples() -> None:
    coalescer = ChunkCoalescer(8)
    sent = []
    sent += coalescer.push(_chunk([1], version=1, sample=0))
    sent += coalescer.push(_chunk([1], version=1, sample=1))
    sent += coalescer.push(_chunk([2], version=1, sample=0))
    sent += coalescer.push(_chunk([3], version=2, sample=0))  # flushes [2] at version 1
    sent += coalescer.push(
        _chunk([4], version=2, sample=0, finish_reason=generation_pb2.FINISH_REASON_STOP)
    )
    sent += coalescer.push(
        _chunk([2], version=1, sample=1, finish_reason=generation_pb2.FINISH_REASON_STOP)
    )
    spans = [(c.sample_index, c.weight_version, list(c.token_ids)) for c in sent]
    assert spans == [(0, 1, [1]), (1, 1, [1]), (0, 1, [2]), (0, 2, [3, 4]), (1, 1, [2])]
    assembler = ResponseAssembler()
    for c in sent:
        assembler.add(c)
    assert [list(s.token_ids) for s in assembler.samples()] == [[1, 2, 3, 4], [1, 2]]


def test_coalescer_interval_zero_or_one_passes_every_chunk() -> None:
    for interval in (0, 1):
        coalescer = ChunkCoalescer(interval)
        assert [list(c.token_ids) for t in (1, 2, 3) for c in coalescer.push(_chunk([t]))] == [
            [1],
            [2],
            [3],
        ]
