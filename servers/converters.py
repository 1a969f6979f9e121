"""Pure conversions between the contract's messages and vLLM's types, with request validation.

No engine and no gRPC context here: every function takes plain values, so each rule is unit
tested directly. Validation raises ``InvalidArgument`` with a message that names the field, the
value and what would be accepted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vllm import SamplingParams as VllmSamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind

from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.v1 import data_plane_pb2, generation_pb2

FINISH_REASONS = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORTED,
}


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int


def validate_prompt(token_ids: Sequence[int], limits: ModelLimits, field_name: str) -> list[int]:
    """Checks a tokenized prompt against the model and returns it as a list."""
    if not token_ids:
        raise InvalidArgument(f"{field_name} is empty: send at least one token id")
    ids = list(token_ids)
    if max(ids) >= limits.vocab_size:
        position = next(i for i, t in enumerate(ids) if t >= limits.vocab_size)
        raise InvalidArgument(
            f"{field_name}[{position}] = {ids[position]} is outside the vocabulary: "
            f"token ids must be in 0..{limits.vocab_size - 1}"
        )
    if len(ids) >= limits.max_model_len:
        raise InvalidArgument(
            f"the prompt has {len(ids)} tokens but the model's context is "
            f"{limits.max_model_len} tokens (prompt plus at least one output token): "
            "shorten the prompt"
        )
    return ids


def resolve_n(n: int) -> int:
    """The contract's ``n`` (0 means 1) as a sample count."""
    if n < 0:
        raise InvalidArgument(f"n = {n}: the number of samples must be >= 1 (0 means 1)")
    return n or 1


def _check_range(
    name: str, value: float, low: float, high: float, *, low_open: bool = False
) -> None:
    too_low = value <= low if low_open else value < low
    if math.isnan(value) or too_low or value > high:
        bracket = "(" if low_open else "["
        raise InvalidArgument(
            f"sampling_params.{name} = {value} is outside {bracket}{low}, {high}]"
        )


def build_sampling_params(
    params: generation_pb2.SamplingParams,
    *,
    n: int,
    prompt_len: int,
    limits: ModelLimits,
    detokenize: bool,
) -> VllmSamplingParams:
    """Validates the contract's sampling parameters and builds vLLM's (streaming deltas)."""
    room = limits.max_model_len - prompt_len
    kwargs: dict[str, Any] = {
        "n": n,
        "output_kind": RequestOutputKind.DELTA,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        # Stop strings are matched on text, so they need detokenization even for token-out.
        "detokenize": detokenize or bool(params.stop_strings),
    }
    if params.stop_strings:
        if any(not s for s in params.stop_strings):
            raise InvalidArgument("sampling_params.stop_strings contains an empty string")
        kwargs["stop"] = list(params.stop_strings)
    bad_stop = [t for t in params.stop_token_ids if t >= limits.vocab_size]
    if bad_stop:
        raise InvalidArgument(
            f"sampling_params.stop_token_ids has {bad_stop[0]}, outside the vocabulary "
            f"0..{limits.vocab_size - 1}"
        )
    if params.HasField("temperature"):
        if math.isnan(params.temperature) or params.temperature < 0:
            raise InvalidArgument(
                f"sampling_params.temperature = {params.temperature}: must be >= 0 (0 = greedy)"
            )
        kwargs["temperature"] = params.temperature
    if params.HasField("top_p"):
        _check_range("top_p", params.top_p, 0.0, 1.0, low_open=True)
        kwargs["top_p"] = params.top_p
    if params.HasField("top_k"):
        if params.top_k < -1:
            raise InvalidArgument(
                f"sampling_params.top_k = {params.top_k}: must be >= 1, or 0 / -1 to disable"
            )
        kwargs["top_k"] = 0 if params.top_k == -1 else params.top_k
    if params.HasField("min_p"):
        _check_range("min_p", params.min_p, 0.0, 1.0)
        kwargs["min_p"] = params.min_p
    if params.HasField("max_tokens"):
        if params.max_tokens <= 0:
            raise InvalidArgument(
                f"sampling_params.max_tokens = {params.max_tokens}: must be >= 1 "
                f"(unset means as many as the context allows, here {room})"
            )
        if params.max_tokens > room:
            raise InvalidArgument(
                f"sampling_params.max_tokens = {params.max_tokens} plus the {prompt_len}-token "
                f"prompt exceeds the model's {limits.max_model_len}-token context: "
                f"use max_tokens <= {room}"
            )
        kwargs["max_tokens"] = params.max_tokens
    else:
        kwargs["max_tokens"] = room
    if params.HasField("min_tokens"):
        if params.min_tokens < 0 or params.min_tokens > kwargs["max_tokens"]:
            raise InvalidArgument(
                f"sampling_params.min_tokens = {params.min_tokens}: must be in "
                f"0..max_tokens ({kwargs['max_tokens']})"
            )
        kwargs["min_tokens"] = params.min_tokens
    if params.HasField("seed"):
        kwargs["seed"] = params.seed
    for name in ("presence_penalty", "frequency_penalty"):
        if params.HasField(name):
            value = getattr(params, name)
            _check_range(name, value, -2.0, 2.0)
            kwargs[name] = value
    if params.HasField("repetition_penalty"):
        _check_range("repetition_penalty", params.repetition_penalty, 0.0, 1e6, low_open=True)
        kwargs["repetition_penalty"] = params.repetition_penalty
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name):
            value = getattr(params, name)
            if value < 0 or value > limits.max_logprobs:
                raise InvalidArgument(
                    f"sampling_params.{name} = {value}: must be in 0..{limits.max_logprobs}"
                )
            kwargs[name] = value
    if params.HasField("skip_special_tokens"):
        kwargs["skip_special_tokens"] = params.skip_special_tokens
    try:
        return VllmSamplingParams(**kwargs)
    except (
        ValueError,
        VLLMValidationError,
    ) as exc:  # vLLM's own checks, for anything we do not pre-validate
        raise InvalidArgument(f"sampling_params rejected: {exc}") from exc


class _LogprobEntry(Protocol):
    logprob: float
    rank: int | None


def logprobs_to_proto(
    token_ids: Sequence[int],
    positions: Iterable[Mapping[int, _LogprobEntry] | None],
    top_k: int,
) -> generation_pb2.Logprobs:
    """vLLM's per-position ``{token_id: Logprob}`` maps as the contract's Logprobs.

    A position without data (the first prompt token) is reported as 0 with no alternatives.
    """
    result = generation_pb2.Logprobs()
    for token_id, position in zip(token_ids, positions, strict=False):
        if position is None:
            result.token_logprobs.append(0.0)
            if top_k:
                result.top_logprobs.add()
            continue
        entry = position.get(token_id)
        result.token_logprobs.append(entry.logprob if entry is not None else float("-inf"))
        if top_k:
            ranked = sorted(
                (
                    (e.rank if e.rank is not None else 1 << 30, t, e.logprob)
                    for t, e in position.items()
                ),
            )[:top_k]
            top = result.top_logprobs.add()
            top.token_ids.extend(t for _, t, _ in ranked)
            top.logprobs.extend(lp for _, _, lp in ranked)
    return result


def finish_to_proto(
    finish_reason: str | None, stop_reason: int | str | None, token_ids: Sequence[int]
) -> tuple[int, generation_pb2.StopMatch | None]:
    """vLLM's finish/stop reasons as the contract's FinishReason and StopMatch."""
    if finish_reason is None:
        return generation_pb2.FINISH_REASON_UNSPECIFIED, None
    reason = FINISH_REASONS.get(finish_reason, generation_pb2.FINISH_REASON_STOP)
    if reason != generation_pb2.FINISH_REASON_STOP:
        return reason, None
    if isinstance(stop_reason, str):
        return reason, generation_pb2.StopMatch(text=stop_reason)
    if isinstance(stop_reason, int):
        return reason, generation_pb2.StopMatch(token_id=stop_reason)
    # None with "stop" means EOS: the sample's last token is the EOS id.
    return reason, generation_pb2.StopMatch(token_id=token_ids[-1]) if token_ids else None


class StreamConverter:
    """Turns one request's vLLM ``RequestOutput`` deltas into the contract's stream chunks."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: VllmSamplingParams,
        include_text: bool,
    ) -> None:
        self.request_id = request_id
        self._prompt_token_ids = prompt_token_ids
        self._logprobs = sampling_params.logprobs
        self._prompt_logprobs = sampling_params.prompt_logprobs
        self._include_text = include_text
        self._usage = generation_pb2.Usage(prompt_tokens=len(prompt_token_ids))
        self._prompt_logprobs_sent = False

    def chunks(
        self, output: Any, weight_version: int
    ) -> list[data_plane_pb2.GenerateStreamResponse]:
        result = []
        if output.num_cached_tokens:
            self._usage.cached_prompt_tokens = output.num_cached_tokens
        for completion in output.outputs:
            token_ids = completion.token_ids
            if not token_ids and completion.finish_reason is None:
                continue
            self._usage.completion_tokens += len(token_ids)
            chunk = data_plane_pb2.GenerateStreamResponse(
                request_id=self.request_id,
                sample_index=completion.index,
                token_ids=token_ids,
                weight_version=weight_version,
            )
            if self._logprobs is not None and completion.logprobs is not None:
                chunk.logprobs.CopyFrom(
                    logprobs_to_proto(token_ids, completion.logprobs, self._logprobs)
                )
            reason, stop = finish_to_proto(
                completion.finish_reason, completion.stop_reason, completion.token_ids
            )
            chunk.finish_reason = reason  # type: ignore[assignment]
            if stop is not None:
                chunk.stop.CopyFrom(stop)
            if self._include_text and completion.text:
                chunk.text = completion.text
            chunk.usage.CopyFrom(self._usage)
            result.append(chunk)
        if result:
            if not self._prompt_logprobs_sent and self._prompt_logprobs is not None:
                self._prompt_logprobs_sent = True
                if output.prompt_logprobs is not None:
                    result[0].prompt_logprobs.CopyFrom(
                        logprobs_to_proto(
                            self._prompt_token_ids, output.prompt_logprobs, self._prompt_logprobs
                        )
                    )
        return result


class ChunkCoalescer:
    """Holds a sample's stream chunks back until ``interval`` new tokens have accumulated.

    Each message costs a serialization here, a relay in the router and a parse in the client;
    merging consecutive chunks cuts that cost by the interval. A sample's first chunk (time to
    first token), its last (finish reason) and a change of weight version (so every message
    still names the one version that produced its tokens) are never held back.
    """

    def __init__(self, interval: int) -> None:
        self._interval = interval
        self._pending: dict[int, data_plane_pb2.GenerateStreamResponse] = {}
        self._started: set[int] = set()

    def push(
        self, chunk: data_plane_pb2.GenerateStreamResponse
    ) -> list[data_plane_pb2.GenerateStreamResponse]:
        """The chunks to send now, oldest first, given the engine's next chunk."""
        if self._interval <= 1:
            return [chunk]
        ready = []
        index = chunk.sample_index
        pending = self._pending.pop(index, None)
        if pending is not None:
            if pending.weight_version != chunk.weight_version:
                ready.append(pending)
            else:
                # MergeFrom appends repeated fields (token ids, logprobs) and keeps the newest
                # scalars (finish reason, cumulative usage); text is a delta, so concatenate it.
                text = pending.text + chunk.text
                pending.MergeFrom(chunk)
                pending.text = text
                chunk = pending
        first = index not in self._started
        self._started.add(index)
        if first or chunk.finish_reason or len(chunk.token_ids) >= self._interval:
            ready.append(chunk)
        else:
            self._pending[index] = chunk
        return ready
