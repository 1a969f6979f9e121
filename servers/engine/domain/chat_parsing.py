"""Chat outputs as assistant messages: tool calls, reasoning and content, found by vLLM's own
parsers under vLLM's own request rules, as plain values (the service's ``chat_convert`` turns
the contract's messages into ``ChatRequestSpec`` and the parsed outputs, ``chat_output``, back
into messages).

A chat generation that offers tools (or runs on a server with a reasoning parser) is described
to vLLM as the ``ChatCompletionRequest`` its OpenAI server would have built, so the same code
decides what vLLM's server decides: whether the tool choice is valid, which constraint a
``required`` or named choice puts on the output (``Parser.adjust_request``), and how the text is
split into reasoning, content and calls (``Parser.parse`` for a whole answer, ``parse_delta``
for a stream). One parser per sample: vLLM's parsers keep per-stream state.

A ``required`` or named tool choice needs no ``--tool-call-parser``: its output is constrained to
the tools' JSON schema, so vLLM's generic JSON reading of forced calls (``DelegatingParser`` with
a tool parser that ``supports_required_and_named``) finds the calls whatever the model's own
call format. Only ``auto``, where free text must be read for calls, needs the model's parser.

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

import json
from dataclasses import dataclass, field
from typing import Any

from servers.engine.domain.chat_output import ChatOutputParsing
from skyrl_grpc.errors import FailedPrecondition, InvalidArgument

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


@dataclass
class ChatParsers:
    """This server's parsers: ``--tool-call-parser``, ``--reasoning-parser`` and
    ``--enable-auto-tool-choice`` as vLLM's server spells them, bound to the tokenizer."""

    tokenizer: Any
    model_name: str
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self._parser_cls: Any = None
        if self.tool_call_parser or self.reasoning_parser:
            from vllm.parser import ParserManager

            self._parser_cls = ParserManager.get_parser(
                tool_parser_name=self.tool_call_parser or None,
                reasoning_parser_name=self.reasoning_parser or None,
                enable_auto_tools=self.enable_auto_tool_choice,
                model_name=self.model_name,
                tokenizer=self.tokenizer,
            )
        # Built at the first forced choice on a server whose parser reads no calls.
        self._forced_parser_cls: Any = None

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
        unchanged = SamplingAdjustments()
        if self._parser_cls is None and not spec.offered:  # plain content: nothing to decide
            return unchanged, ChatOutputParsing(
                [None] * n, None, prompt_token_ids, *spec.output_form, False
            )
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
        request = self._request(spec, choice)
        self._check_supported(request)
        parser_cls = self._parser_for(request.tool_choice)
        if parser_cls is None:
            return unchanged, ChatOutputParsing(
                [None] * n, request, prompt_token_ids, *spec.output_form, False
            )

        def new_parser() -> Any:
            return parser_cls(self.tokenizer, request.tools)

        parsers = [new_parser() for _ in range(n)]
        # vLLM's rule: the parser adjusts the request (a JSON schema for required / named
        # choices, special tokens kept for markers that are special tokens).
        adjusted = parsers[0].adjust_request(request.model_copy(deep=True))
        parsing = ChatOutputParsing(
            parsers,
            adjusted,
            prompt_token_ids,
            *spec.output_form,
            self.enable_auto_tool_choice,
            new_parser=new_parser,
        )
        return _adjustments(request, adjusted), parsing

    def _request(self, spec: ChatRequestSpec, choice: ToolChoice) -> Any:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMValidationError

        body: dict[str, Any] = {"model": self.model_name, "messages": []}
        if spec.tools:
            tools = json.loads(json.dumps(spec.tools))  # a copy: made strict below
            if choice == "required" or isinstance(choice, dict):
                # A forced call's arguments follow its tool's schema, parser or not.
                for tool in tools:
                    tool["function"]["strict"] = True
            body["tools"] = tools
        if choice is not None:
            body["tool_choice"] = choice
        if spec.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = spec.parallel_tool_calls
        if spec.structured_outputs is not None:
            # The caller's constraint, for the parser to combine with the calls' (auto).
            body["structured_outputs"] = spec.structured_outputs
        try:
            return ChatCompletionRequest.model_validate(body)
        except (ValidationError, ValueError, VLLMValidationError) as exc:
            raise InvalidArgument(f"tool_use: {_first_error(exc)}") from exc

    def _check_supported(self, request: Any) -> None:
        """vLLM's server's refusal of a tool choice this server was not started for: ``auto``
        reads calls out of free text, in the model's own format, which only its parser knows."""
        if request.tool_choice != "auto":
            return
        if not (self.tool_call_parser and self.enable_auto_tool_choice):
            raise FailedPrecondition(
                '"auto" tool choice needs a server started with --enable-auto-tool-choice and '
                "--tool-call-parser"
            )

    def _parser_for(self, choice: Any) -> Any:
        """The parser class for a request with this (validated) tool choice, or None when
        its output is all content. A forced choice (``required``, or a named function after
        validation) is read as JSON calls unless the server's parser reads calls itself."""
        forced = choice == "required" or hasattr(choice, "function")
        configured = self._parser_cls
        if not forced or (configured is not None and configured.tool_parser_cls is not None):
            return configured
        if self._forced_parser_cls is None:
            self._forced_parser_cls = _forced_calls_parser(self.reasoning_parser)
        return self._forced_parser_cls


def _forced_calls_parser(reasoning_parser: str) -> Any:
    """vLLM's composed parser (``DelegatingParser``) for forced tool choices: this server's
    reasoning parser, if any, and a tool parser that only says it takes vLLM's standard JSON
    form of forced calls. vLLM's own code then does the rest: ``adjust_request`` constrains the
    output to the tools' schema (``get_json_schema_from_tools``), ``parse`` and ``parse_delta``
    read the calls from it (as a list for ``required``, as the arguments for a named one)."""
    from vllm.parser import ParserManager
    from vllm.parser.abstract_parser import DelegatingParser
    from vllm.tool_parsers.abstract_tool_parser import ToolParser

    class JsonCallsToolParser(ToolParser):
        supports_required_and_named = True

        def extract_tool_calls(self, model_output: str, request: Any) -> Any:
            raise AssertionError("forced calls are read by vLLM's JSON path, never as auto")

        def extract_tool_calls_streaming(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("forced calls are read by vLLM's JSON path, never as auto")

    class ForcedCallsParser(DelegatingParser):
        reasoning_parser_cls = ParserManager.get_reasoning_parser(reasoning_parser or None)
        tool_parser_cls = JsonCallsToolParser

    return ForcedCallsParser


def _adjustments(before: Any, after: Any) -> SamplingAdjustments:
    """What the parser changed on the request: a constraint, special tokens."""
    json_schema = structural_tag = None
    constraint = after.structured_outputs
    if constraint is not None and constraint != before.structured_outputs:
        if constraint.json is not None:
            schema = constraint.json
            json_schema = schema if isinstance(schema, str) else json.dumps(schema)
        elif constraint.structural_tag is not None:
            tag = constraint.structural_tag
            structural_tag = tag if isinstance(tag, str) else json.dumps(tag)
        else:
            raise FailedPrecondition(
                f"the tool-call parser set a constraint the contract lacks: {constraint}"
            )
    skip = after.skip_special_tokens
    return SamplingAdjustments(
        json_schema=json_schema,
        structural_tag=structural_tag,
        skip_special_tokens=skip if skip != before.skip_special_tokens else None,
    )


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        found = errors()
        if found:
            message = str(found[0].get("msg", exc))
            return message.removeprefix("Value error, ")
    return str(exc)
