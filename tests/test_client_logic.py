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
