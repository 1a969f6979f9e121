"""Folding stream chunks into whole samples: shared by the server's unary RPCs and the client.

Consecutive chunks with the same weight version extend one WeightVersionSpan, so a sample
generated across a weight update reports which tokens came from which version. A sample that
is continued after an abort (the client's retry) simply receives more chunks: the last finish
reason wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from skyrl_grpc import routed_experts
from skyrl_grpc.v1 import chat_tools_pb2, data_plane_pb2, generation_pb2


@dataclass
class _SampleState:
    sample: generation_pb2.Sample
    text_parts: list[str] = field(default_factory=list)


class ResponseAssembler:
    """Folds a request's stream chunks into whole samples (for the unary RPCs).

    Consecutive chunks with the same weight version extend one WeightVersionSpan, so a sample
    generated across a weight update reports which tokens came from which version.
    """

    def __init__(self) -> None:
        self._samples: dict[int, _SampleState] = {}
        self.request_id = ""
        self.usage = generation_pb2.Usage()
        self.prompt_logprobs: generation_pb2.Logprobs | None = None
        # Each sample's parsed assistant message (requests with chat_output.whole_messages).
        self.chat_messages: dict[int, chat_tools_pb2.ChatMessageOut] = {}

    def add(self, chunk: data_plane_pb2.GenerateStreamResponse) -> None:
        self.request_id = chunk.request_id
        self.usage.CopyFrom(chunk.usage)
        if chunk.HasField("prompt_logprobs"):
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.HasField("chat_message"):
            self.chat_messages[chunk.sample_index] = chunk.chat_message
        state = self._samples.get(chunk.sample_index)
        if state is None:
            state = _SampleState(generation_pb2.Sample(index=chunk.sample_index))
            self._samples[chunk.sample_index] = state
        sample = state.sample
        if chunk.lora_version:
            sample.lora_version = chunk.lora_version
        if chunk.token_ids:
            spans = sample.weight_versions
            if spans and spans[-1].weight_version == chunk.weight_version:
                spans[-1].length += len(chunk.token_ids)
            else:
                spans.add(
                    weight_version=chunk.weight_version,
                    start=len(sample.token_ids),
                    length=len(chunk.token_ids),
                )
            sample.token_ids.extend(chunk.token_ids)
        if chunk.HasField("logprobs"):
            sample.logprobs.token_logprobs.extend(chunk.logprobs.token_logprobs)
            sample.logprobs.top_logprobs.extend(chunk.logprobs.top_logprobs)
        if chunk.text:
            state.text_parts.append(chunk.text)
        if chunk.finish_reason:
            sample.finish_reason = chunk.finish_reason
            if chunk.HasField("stop"):
                sample.stop.CopyFrom(chunk.stop)
        if chunk.HasField("routed_experts"):  # each step's rows after those before (a
            # continuation starts where the rows received end: ``continuation``)
            if sample.HasField("routed_experts"):
                joined = routed_experts.concatenate(sample.routed_experts, chunk.routed_experts)
                sample.routed_experts.CopyFrom(joined)
            else:
                sample.routed_experts.CopyFrom(chunk.routed_experts)

    def samples(self) -> list[generation_pb2.Sample]:
        """The samples ordered by index, texts joined."""
        result = []
        for index in sorted(self._samples):
            state = self._samples[index]
            state.sample.text = "".join(state.text_parts)
            result.append(state.sample)
        return result
