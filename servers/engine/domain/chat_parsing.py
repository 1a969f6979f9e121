"""Chat outputs as assistant messages: tool calls, reasoning and content, found by vLLM's own
parsers under vLLM's own request rules, as plain values (the service's ``chat_convert`` turns
the contract's messages into ``ChatRequestSpec`` and the parsed outputs, ``chat_output``, back
into messages).

A chat generation that offers tools (or runs on a server with a reasoning parser) is described
to vLLM as the ``ChatCompletionRequest`` its OpenAI server would have built, so the same code
decides what vLLM's server decides: whether the tool choice is valid, which constraint a
``required`` or named choice puts on the output, and how the text is split into reasoning,
content and calls; every call into vLLM is ``vllm_adapter.chat_parser_calls``'. One parser per
sample: vLLM's parsers keep per-stream state. A ``required`` or named tool choice needs no
``--tool-call-parser`` (its output is constrained to the tools' JSON schema); only ``auto``,
where free text must be read for calls, needs the model's parser.

Where this server is stricter than vLLM's, on forced choices (a caller who forces a call gets a
call it can run, or the text):
- every offered tool is treated as ``strict``, so a parser's structural tag pins the arguments to
  the tool's JSON Schema too (vLLM's server with ``hermes`` leaves them free: ``"arguments":
  Infinity``);
- a call is returned only when its arguments are a JSON object that follows its tool's schema,
  each as soon as it is complete (streamed: whole, in one delta): an answer cut off by
  ``max_tokens`` carries the calls it completed (``finish_reason`` ``length``) and drops the
  cut one; an answer with no complete call carries its generated text as ``content``, as
  vLLM's server does for every cut-off (``chat_output.CompleteCalls``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servers.engine.domain.chat_output import ChatOutputParsing, SampleParsers
from servers.engine.vllm_adapter.chat_parser_calls import VllmChatParsers
from skyrl_grpc.errors import InvalidArgument

ToolChoice = str | dict[str, Any] | None


@dataclass(frozen=True)
class ChatRequestSpec:
    """What a chat generation asks of the parsers, as OpenAI's API writes it."""

    # The offered tools, checked (``{"type": "function", "function": {...}}``).
    tools: list[dict[str, Any]] = field(default_factory=list)
    # "none", "auto", "required", ``{"type": "function", "function": {"name": ...}}``, or None.
    choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    # The caller's own constraint, as vLLM's ``StructuredOutputsParams`` fields (None: none).
    structured_outputs: dict[str, Any] | None = None
    # Tokens at the end of the prompt that are the sample's output so far (a resumed one).
    resumed_tokens: int = 0
    # Parse each sample once, whole, at its end (else: a delta per stream message).
    whole_messages: bool = False

    @property
    def offered(self) -> bool:
        return bool(self.tools) or self.choice is not None

    @property
    def output_form(self) -> tuple[int, bool]:
        """How its samples' output is read: ``resumed_tokens``, ``whole_messages``."""
        return self.resumed_tokens, self.whole_messages


@dataclass(frozen=True)
class SamplingAdjustments:
    """What vLLM's rules change in a request's sampling: a constraint for forced calls (JSON
    schema or structural tag, as JSON text) and whether special tokens stay in the text."""

    json_schema: str | None = None
    structural_tag: str | None = None
    skip_special_tokens: bool | None = None


class ChatParsers:
    """The chat rules of this server: the request's tool choice checked against what it
    offers, then vLLM's parsers (``vllm_adapter.chat_parser_calls``: the server's
    ``--tool-call-parser``, ``--reasoning-parser``, ``--enable-auto-tool-choice``) deciding the
    rest and parsing the samples."""

    def __init__(self, vllm: VllmChatParsers) -> None:
        self._vllm = vllm

    def prepare(
        self, spec: ChatRequestSpec, prompt_token_ids: list[int], n: int
    ) -> tuple[SamplingAdjustments, ChatOutputParsing]:
        """What vLLM's server would change in this chat request's sampling (a required or
        named tool choice constrains the output) and the parsing of its samples."""
        if spec.resumed_tokens and (n != 1 or spec.resumed_tokens >= len(prompt_token_ids)):
            raise InvalidArgument(
                "chat_output.resumed_tokens: a resumed generation has one sample and a prompt "
                "longer than its tokens so far"
            )
        prompt = prompt_token_ids[: len(prompt_token_ids) - spec.resumed_tokens]
        if not self._vllm.configured and not spec.offered:  # plain content: nothing to decide
            plain = ChatOutputParsing(None, prompt_token_ids, *spec.output_form, n)
            return SamplingAdjustments(), plain
        choice = spec.choice if spec.offered else None
        if choice is not None and not spec.tools:
            raise InvalidArgument("tool_use.tool_choice: offer tools to choose from")
        names = [tool["function"]["name"] for tool in spec.tools]
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise InvalidArgument(
                f"tool_choice names function {choice['function']['name']!r}, which is not "
                f"among the tools offered: {', '.join(names)}"
            )
        if isinstance(choice, dict) and spec.structured_outputs is not None:
            raise InvalidArgument(
                "a named tool_choice constrains the output to that function's arguments: "
                "drop sampling_params.structured_output (or use tool_choice auto)"
            )
        parsed, parsers, new_parser = self._vllm.prepare(
            spec.tools, choice, spec.parallel_tool_calls, spec.structured_outputs, prompt, n
        )
        samples = None  # no parser: the output is all content
        if parsers is not None and new_parser is not None:
            samples = SampleParsers(parsed, parsers, new_parser)
        adjustments = SamplingAdjustments(
            parsed.json_schema, parsed.structural_tag, parsed.skip_special_tokens
        )
        return adjustments, ChatOutputParsing(samples, prompt_token_ids, *spec.output_form, n)
