"""What a generation returns: plain results a trainer consumes (no protobuf downstream; the
control calls' results are in ``fleet_info``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from skyrl_grpc import finish_reasons
from skyrl_grpc.routed_experts import unpack as unpack_routed_experts
from skyrl_grpc.v1 import generation_pb2
from trainer_client.tool_use import AssistantMessage


class FinishReason(StrEnum):
    """Why a sample ended; the values are the names vLLM, OpenAI and SkyRL use
    (``skyrl_grpc.finish_reasons``)."""

    STOP = finish_reasons.STOP
    LENGTH = finish_reasons.LENGTH
    ABORTED = finish_reasons.ABORT
    UNFINISHED = "unfinished"

    @classmethod
    def from_proto(cls, value: int) -> FinishReason:
        name = finish_reasons.name_of(value)
        return cls.UNFINISHED if name is None else cls(name)


@dataclass(frozen=True)
class WeightSpan:
    """Tokens ``start .. start + length - 1`` of the output came from ``weight_version``."""

    weight_version: int
    start: int
    length: int


@dataclass
class GenerationResult:
    """One finished sample."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    # Per position, the most likely (token id, logprob) pairs, when asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_token_id: int | None = None
    stop_text: str | None = None
    text: str | None = None
    weight_versions: list[WeightSpan] = field(default_factory=list)
    # The LoRA adapter version that produced the sample (0: the base model).
    lora_version: int = 0
    # How many times the sample was resubmitted after an abort (0: uninterrupted).
    abort_retries: int = 0
    # Prompt tokens the server served from its prefix cache instead of computing them (of the
    # first attempt, when resubmitted): how much a session's placement saved.
    cached_prompt_tokens: int = 0
    # Chat: the output as the servers parsed it (content, reasoning, tool calls).
    message: AssistantMessage | None = None
    # With sampling's return_routed_experts: the experts each MoE layer routed each token to,
    # a numpy array [tokens, layers, experts per token] (skyrl_grpc.routed_experts: the prompt's
    # tokens from routed_experts_prompt_start, then the output's but the last).
    routed_experts: Any = None

    @classmethod
    def from_sample(
        cls, prompt: list[int], sample: generation_pb2.Sample, with_logprobs: bool, retries: int = 0
    ) -> GenerationResult:
        stop = sample.stop if sample.HasField("stop") else None
        top = None
        if with_logprobs and sample.logprobs.top_logprobs:
            top = [
                list(zip(t.token_ids, t.logprobs, strict=True))
                for t in sample.logprobs.top_logprobs
            ]
        return cls(
            prompt_token_ids=prompt,
            token_ids=list(sample.token_ids),
            finish_reason=FinishReason.from_proto(sample.finish_reason),
            logprobs=list(sample.logprobs.token_logprobs) if with_logprobs else None,
            top_logprobs=top,
            stop_token_id=stop.token_id if stop is not None and stop.HasField("token_id") else None,
            stop_text=stop.text if stop is not None and stop.HasField("text") else None,
            text=sample.text or None,
            weight_versions=[
                WeightSpan(s.weight_version, s.start, s.length) for s in sample.weight_versions
            ],
            abort_retries=retries,
            lora_version=sample.lora_version,
            routed_experts=(
                unpack_routed_experts(sample.routed_experts)
                if sample.HasField("routed_experts")
                else None
            ),
        )


class WeightVersions(dict[str, int]):
    """The weight version each server serves. Servers can differ: a server that restarted
    with no peer to catch up from serves the weights it started from (version 0) until the
    trainer pushes again."""

    @property
    def newest(self) -> int:
        return max(self.values(), default=0)

    @property
    def consistent(self) -> bool:
        """Every server serves the same version."""
        return len(set(self.values())) <= 1

    def behind(self) -> list[str]:
        """Servers serving an older version than the newest, sorted."""
        newest = self.newest
        return sorted(address for address, version in self.items() if version < newest)
