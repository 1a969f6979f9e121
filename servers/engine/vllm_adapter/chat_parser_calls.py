"""vLLM's chat parsers as plain calls (the domain's ``chat_parsing`` and ``chat_output`` hold
the rules; this module is every call they make into vLLM): a chat request described to vLLM as
the ``ChatCompletionRequest`` its OpenAI server would have built (so vLLM decides whether the
tool choice is valid and which constraint a forced choice puts on the output), and per-sample
parsers whose answers are plain values (``DeltaValues``, ``CallValues``).

A ``required`` or named tool choice needs no ``--tool-call-parser``: its output is constrained
to the tools' JSON schema and read by vLLM's generic JSON reading of forced calls
(``DelegatingParser`` with a tool parser that ``supports_required_and_named``); only ``auto``,
where free text must be read for calls, needs the model's parser.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from skyrl_grpc.errors import FailedPrecondition, InvalidArgument


@dataclass(frozen=True)
class CallPiece:
    """A piece of a streamed tool call, as vLLM's ``DeltaToolCall`` says it."""

    index: int
    id: str | None
    type: str | None
    name: str | None
    arguments: str | None


class DeltaValues(NamedTuple):
    """What one streamed delta of a sample says (vLLM's ``DeltaMessage``)."""

    content: str | None
    content_null: bool  # the parser said content is null, not absent
    reasoning: str | None
    calls: list[CallPiece]


class CallValues(NamedTuple):
    """A whole answer's tool call (vLLM's ``FunctionCall``); ``id`` may be empty."""

    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedRequest:
    """A chat request as vLLM's rules left it: whether its tool choice forces a call, whether
    auto tool calls are read, each offered tool's parameters schema, and what the parser
    changed in its sampling (a constraint as JSON text, special tokens kept)."""

    forced: bool
    auto_tools: bool
    schemas: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    json_schema: str | None = None
    structural_tag: str | None = None
    skip_special_tokens: bool | None = None


class SampleParser:
    """vLLM's parser of one sample (its parsers keep per-stream state), answering plainly."""

    def __init__(
        self, parser: Any, request: Any, prompt_token_ids: list[int], enable_auto_tools: bool
    ) -> None:
        self._parser = parser
        self._request = request
        self._prompt = prompt_token_ids
        # The server's --enable-auto-tool-choice: vLLM's whole parse reads calls only with it
        # (a hermes server's forced calls are in hermes' tags, read by the same parse).
        self._enable_auto_tools = enable_auto_tools

    def delta(self, text: str, token_ids: list[int], finished: bool) -> DeltaValues | None:
        """The next delta of the sample (None: the parser holds these tokens back)."""
        delta = self._parser.parse_delta(
            delta_text=text,
            delta_token_ids=token_ids,
            request=self._request,
            prompt_token_ids=self._prompt,
            finished=finished,
        )
        if delta is None:
            return None
        pieces = [
            CallPiece(
                call.index,
                call.id,
                call.type,
                call.function.name if call.function is not None else None,
                call.function.arguments if call.function is not None else None,
            )
            for call in delta.tool_calls
        ]
        null = delta.content is None and "content" in delta.model_fields_set
        return DeltaValues(delta.content, null, delta.reasoning, pieces)

    def whole(
        self, text: str, token_ids: list[int]
    ) -> tuple[str | None, str | None, list[CallValues]]:
        """The whole sample: its reasoning, content and tool calls."""
        self._parser.set_prompt_token_ids(self._prompt)
        reasoning, content, calls = self._parser.parse(
            text,
            self._request,
            enable_auto_tools=self._enable_auto_tools,
            model_output_token_ids=token_ids,
        )
        found = [CallValues(call.id or "", call.name, call.arguments) for call in calls or []]
        return reasoning, content, found

    def content_after_reasoning(self, text: str) -> str:
        """The part of ``text`` that is not reasoning (all of it without a reasoning parser)."""
        extract = getattr(self._parser, "extract_reasoning", None)
        if extract is None:
            return text
        _, content = extract(text, self._request)
        return content or ""

    def reasoning_start(self) -> tuple[int, str] | None:
        """The reasoning parser's start marker (token id, text), where it has one."""
        reasoning = getattr(self._parser, "_reasoning_parser", None)
        token_id = getattr(reasoning, "start_token_id", None)
        token = getattr(reasoning, "start_token", None)
        if isinstance(token_id, int) and isinstance(token, str) and token:
            return token_id, token
        return None


def new_call_id() -> str:
    """A tool call id as vLLM's server makes them."""
    from vllm.renderers.chat_utils import make_tool_call_id

    return str(make_tool_call_id())


@dataclass
class VllmChatParsers:
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

    @property
    def configured(self) -> bool:
        """Whether the server has a parser of its own (else plain content, unless tools)."""
        return self._parser_cls is not None

    def prepare(
        self,
        tools: list[dict[str, Any]],
        choice: str | dict[str, Any] | None,
        parallel_tool_calls: bool | None,
        structured_outputs: dict[str, Any] | None,
        prompt_token_ids: list[int],
        n: int,
    ) -> tuple[ParsedRequest, list[SampleParser] | None, Callable[[], SampleParser] | None]:
        """The request checked by vLLM's rules, a parser per sample (None: its output is all
        content) and a maker of one more (the domain replays a sample through a fresh one)."""
        request = self._request(tools, choice, parallel_tool_calls, structured_outputs)
        self._check_supported(request)
        parser_cls = self._parser_for(request.tool_choice)
        forced = _forced(request.tool_choice)
        if parser_cls is None:
            return ParsedRequest(forced=False, auto_tools=False), None, None
        parsers = [parser_cls(self.tokenizer, request.tools) for _ in range(n)]
        # vLLM's rule: the parser adjusts the request (a JSON schema for required / named
        # choices, special tokens kept for markers that are special tokens).
        adjusted = parsers[0].adjust_request(request.model_copy(deep=True))

        def new_parser() -> SampleParser:
            parser = parser_cls(self.tokenizer, request.tools)
            return SampleParser(parser, adjusted, prompt_token_ids, self.enable_auto_tool_choice)

        schemas = {tool.function.name: tool.function.parameters for tool in adjusted.tools or []}
        auto = (
            self.enable_auto_tool_choice and bool(adjusted.tools) and adjusted.tool_choice == "auto"
        )
        parsed = ParsedRequest(forced, auto, schemas, *_adjustments(request, adjusted))
        samples = [
            SampleParser(parser, adjusted, prompt_token_ids, self.enable_auto_tool_choice)
            for parser in parsers
        ]
        return parsed, samples, new_parser

    def _request(
        self,
        tools: list[dict[str, Any]],
        choice: str | dict[str, Any] | None,
        parallel_tool_calls: bool | None,
        structured_outputs: dict[str, Any] | None,
    ) -> Any:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMValidationError

        body: dict[str, Any] = {"model": self.model_name, "messages": []}
        if tools:
            copied = json.loads(json.dumps(tools))  # a copy: made strict below
            if choice == "required" or isinstance(choice, dict):
                # A forced call's arguments follow its tool's schema, parser or not.
                for tool in copied:
                    tool["function"]["strict"] = True
            body["tools"] = copied
        if choice is not None:
            body["tool_choice"] = choice
        if parallel_tool_calls is not None:
            body["parallel_tool_calls"] = parallel_tool_calls
        if structured_outputs is not None:
            # The caller's constraint, for the parser to combine with the calls' (auto).
            body["structured_outputs"] = structured_outputs
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
        configured = self._parser_cls
        if not _forced(choice) or (configured is not None and configured.tool_parser_cls):
            return configured
        if self._forced_parser_cls is None:
            self._forced_parser_cls = _forced_calls_parser(self.reasoning_parser)
        return self._forced_parser_cls


def _forced(choice: Any) -> bool:
    """Whether a validated tool choice forces a call (a named one is vLLM's
    ChatCompletionNamedToolChoiceParam by then)."""
    return choice == "required" or hasattr(choice, "function")


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


def _adjustments(before: Any, after: Any) -> tuple[str | None, str | None, bool | None]:
    """What the parser changed on the request: a constraint (JSON schema or structural tag,
    as JSON text), special tokens."""
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
    return json_schema, structural_tag, skip if skip != before.skip_special_tokens else None


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        found = errors()
        if found:
            message = str(found[0].get("msg", exc))
            return message.removeprefix("Value error, ")
    return str(exc)
