"""The trainer client's own rules, against stand-in backends (no engine): what it returns when
generations are aborted, and how a batch fails."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.helpers.fake_backend import FakeBackend
from trainer_client import FinishReason, InferenceClient


@pytest.fixture
async def aborting_backend() -> AsyncIterator[FakeBackend]:
    """A backend that aborts every stream after 3 tokens, as a paused server would."""
    backend = await FakeBackend("aborting", delay=0.001).start()
    backend.servicer.abort_after_tokens = 3
    yield backend
    await backend.stop()


@pytest.mark.parametrize("retries", [0, 1, 3])
async def test_a_sample_aborted_past_its_retries_is_returned_as_aborted(
    aborting_backend: FakeBackend, retries: int
) -> None:
    # One rule whatever the limit: the sample comes back, never an exception.
    client = InferenceClient(aborting_backend.address, direct=False, max_abort_retries=retries)
    result = await client.generate([1, 2, 3], {"max_tokens": 50})
    assert result.finish_reason == FinishReason.ABORTED
    assert result.abort_retries == retries
    assert len(result.token_ids) == 3 * (retries + 1)  # every attempt's tokens are kept
    assert aborting_backend.observed.calls == retries + 1
    await client.close()


def test_finish_reasons_read_as_vllm_openai_and_skyrl_name_them() -> None:
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "unfinished"]


def test_budget_used_up_by_aborted_tokens_ends_as_length() -> None:
    from skyrl_grpc.v1 import data_plane_pb2, generation_pb2
    from trainer_client.abort_retry import AbortRetry

    retry = AbortRetry([1, 2], generation_pb2.SamplingParams(max_tokens=3))
    assert retry.request().min_weight_version == 0
    retry.add(data_plane_pb2.GenerateStreamResponse(token_ids=[5], weight_version=3))
    retry.add(
        data_plane_pb2.GenerateStreamResponse(
            token_ids=[6], finish_reason=generation_pb2.FINISH_REASON_ABORTED, weight_version=3
        )
    )
    assert retry.should_resubmit()
    request = retry.request()
    assert (
        list(request.prompt_token_ids) == [1, 2, 5, 6] and request.sampling_params.max_tokens == 1
    )
    # It goes on only where the weights are at least those of its tokens.
    assert request.min_weight_version == 3
    retry.add(
        data_plane_pb2.GenerateStreamResponse(
            token_ids=[7], finish_reason=generation_pb2.FINISH_REASON_ABORTED
        )
    )
    assert not retry.should_resubmit()
    assert retry.sample().finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert list(retry.sample().token_ids) == [5, 6, 7]


def test_a_constrained_sample_cut_by_an_abort_starts_over() -> None:
    from skyrl_grpc.v1 import data_plane_pb2, generation_pb2
    from trainer_client.abort_retry import AbortRetry

    params = generation_pb2.SamplingParams(
        max_tokens=8, structured_output=generation_pb2.StructuredOutput(regex="(ab)+")
    )
    retry = AbortRetry([1, 2], params)
    retry.add(
        data_plane_pb2.GenerateStreamResponse(
            token_ids=[5, 6], finish_reason=generation_pb2.FINISH_REASON_ABORTED
        )
    )
    assert retry.should_resubmit()
    again = retry.request()
    assert list(again.prompt_token_ids) == [1, 2] and again.sampling_params.max_tokens == 8
    assert retry.token_ids == []  # the cut attempt's tokens are dropped, not spliced
    retry.add(
        data_plane_pb2.GenerateStreamResponse(
            token_ids=[7, 8, 9], finish_reason=generation_pb2.FINISH_REASON_STOP
        )
    )
    assert not retry.should_resubmit()
    assert list(retry.sample().token_ids) == [7, 8, 9] and retry.retries == 1


def test_a_sample_lost_after_its_last_token_is_finished_not_continued_for_zero_tokens() -> None:
    """A stream lost after every token of its budget arrived but before its end (the failover
    of the direct path): the sample is finished LENGTH, as an uninterrupted run is, instead of
    a continuation asking for 0 more tokens, which servers refuse (INVALID_ARGUMENT)."""
    from skyrl_grpc.v1 import data_plane_pb2, generation_pb2
    from trainer_client.abort_retry import AbortRetry

    retry = AbortRetry([1, 2], generation_pb2.SamplingParams(max_tokens=3))
    retry.add(data_plane_pb2.GenerateStreamResponse(token_ids=[5, 6]))
    assert not retry.finished_by_budget()  # one token left: it goes on elsewhere
    assert retry.request().sampling_params.max_tokens == 1
    retry.add(data_plane_pb2.GenerateStreamResponse(token_ids=[7]))
    assert retry.finished_by_budget()
    sample = retry.sample()
    assert list(sample.token_ids) == [5, 6, 7]
    assert sample.finish_reason == generation_pb2.FINISH_REASON_LENGTH
