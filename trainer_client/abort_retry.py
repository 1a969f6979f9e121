"""Retry on abort, as a pure state machine (no I/O).

When a pause in ABORT mode (a weight update) cuts a generation, the client resubmits the prompt
plus every token generated so far, with the remaining token budget, to the same session
(``skyrl_grpc.continuation``, the rule the router's migration follows too). Tokens and logprobs
accumulate as ids (never through text), so the final result looks exactly like an
uninterrupted generation -- except for a constrained output (a structured output or tools),
which starts over (``skyrl_grpc.continuation.resumable``). ``AbortRetry`` decides what to send
next and when to stop.
"""

from __future__ import annotations

from skyrl_grpc.continuation import continue_request, resumable
from skyrl_grpc.sample_assembly import ResponseAssembler
from skyrl_grpc.v1 import chat_tools_pb2, data_plane_pb2, generation_pb2


class AbortRetry:
    """Accumulates one sample across resubmissions."""

    def __init__(
        self,
        prompt_token_ids: list[int],
        sampling_params: generation_pb2.SamplingParams,
        include_text: bool = False,
        max_abort_retries: int | None = None,
        stream_interval: int = 0,
        lora: str = "",
        chat_output: chat_tools_pb2.ChatOutput | None = None,
    ) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.lora = lora
        self.sampling_params = sampling_params
        self.include_text = include_text
        self.max_abort_retries = max_abort_retries
        self.stream_interval = stream_interval
        # Chat: the servers parse the output into an assistant message (tool calls).
        self.chat_output = chat_output
        self.retries = 0
        # Of the prompt, tokens the server took from its prefix cache (first attempt).
        self.cached_prompt_tokens = 0
        self._assembler = ResponseAssembler()
        self._budget = (
            sampling_params.max_tokens if sampling_params.HasField("max_tokens") else None
        )

    @property
    def token_ids(self) -> list[int]:
        samples = self._assembler.samples()
        return list(samples[0].token_ids) if samples else []

    def request(self, request_id: str = "") -> data_plane_pb2.GenerateStreamRequest:
        """The next request: prompt + generated tokens, with what is left of the budget."""
        first = data_plane_pb2.GenerateStreamRequest(
            request_id=request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            include_text=self.include_text,
            stream_interval=self.stream_interval,
            lora=self.lora,
            chat_output=self.chat_output,
        )
        sample = self.sample()  # assembled once: its tokens and their weight versions
        if not sample.token_ids:
            return first
        if not resumable(first):
            # A constrained output cannot go on mid-way: the sample starts over.
            self._assembler = ResponseAssembler()
            return first
        # A continuation goes on no older weights than its tokens' newest.
        newest = max(span.weight_version for span in sample.weight_versions)
        rows = sample.routed_experts.tokens  # the continuation's routing starts after them
        return continue_request(first, list(sample.token_ids), newest, rows)

    def add(self, chunk: data_plane_pb2.GenerateStreamResponse) -> None:
        if self.retries == 0 and chunk.HasField("usage"):
            self.cached_prompt_tokens = chunk.usage.cached_prompt_tokens
        self._assembler.add(chunk)

    def message(self) -> chat_tools_pb2.ChatMessageOut | None:
        """The parsed assistant message (chat), from the attempt that finished the sample."""
        return self._assembler.chat_messages.get(0)

    def sample(self) -> generation_pb2.Sample:
        samples = self._assembler.samples()
        return samples[0] if samples else generation_pb2.Sample()

    def finished_by_budget(self) -> bool:
        """True, the sample then finished LENGTH, when every token of its budget arrived: an
        uninterrupted run ends there, and a continuation would ask for 0 tokens (refused). A
        stream lost after its last token but before its end, or aborted at its last token."""
        if self._budget is None or len(self.sample().token_ids) < self._budget:
            return False
        self._assembler.add(
            data_plane_pb2.GenerateStreamResponse(finish_reason=generation_pb2.FINISH_REASON_LENGTH)
        )
        return True

    def should_resubmit(self) -> bool:
        """After a stream ended: True if it was aborted and budget (and retries) remain.

        An aborted sample whose budget is used up is finished: it becomes LENGTH, exactly as an
        uninterrupted run would have ended.
        """
        sample = self.sample()
        if sample.finish_reason != generation_pb2.FINISH_REASON_ABORTED:
            return False
        if self.finished_by_budget():
            return False
        if self.max_abort_retries is not None and self.retries >= self.max_abort_retries:
            return False
        self.retries += 1
        return True
