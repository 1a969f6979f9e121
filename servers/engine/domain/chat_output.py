"""The parsing of a chat generation's samples by vLLM's parsers (built by ``chat_parsing``'s
``ChatParsers.prepare``): each streamed message's delta, or each sample's whole message at its
end, as plain values: content, reasoning and tool calls (with the rule for forced choices:
calls that follow their tools' schemas, or the text).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCallPiece:
    """A piece of a streamed tool call (OpenAI's ``delta.tool_calls`` entry)."""

    index: int
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ParsedDelta:
    """What one streamed message adds to a sample's assistant message."""

    content: str | None = None
    # True when the parser said the content is null (not absent) in this delta.
    content_null: bool = False
    reasoning: str | None = None
    tool_calls: list[ToolCallPiece] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedMessage:
    """A sample's whole assistant message."""

    content: str | None
    reasoning: str | None = None
    tool_calls: tuple[ParsedCall, ...] = ()


class ChatOutputParsing:
    """One request's samples parsed as they stream (``delta``) or once each sample ends
    (``whole``)."""

    def __init__(
        self,
        parsers: list[Any],
        request: Any,
        prompt_token_ids: list[int],
        resumed: int,
        whole_messages: bool,
        enable_auto_tools: bool,
    ) -> None:
        # None for each sample where no parser is configured: its text is all content.
        self._parsers = parsers
        self._request = request
        # ``resumed``: tokens at the end of the prompt that are the sample's output so far.
        self._prompt = prompt_token_ids[: len(prompt_token_ids) - resumed]
        self.whole_messages = whole_messages
        self._enable_auto_tools = enable_auto_tools
        self._texts = [""] * len(parsers)
        self._token_ids: list[list[int]] = [[] for _ in parsers]
        self._resumed = prompt_token_ids[len(prompt_token_ids) - resumed :] if resumed else []

    def resume(self, decode: Callable[[list[int]], str]) -> None:
        """Reads the sample's output so far (``resumed_tokens``) into its parser; what it
        yields was sent before, by the server that generated it."""
        if not self._resumed:
            return
        text = decode(self._resumed)
        if self.whole_messages or self._parsers[0] is None:
            self._texts[0], self._token_ids[0] = text, list(self._resumed)
            return
        self._feed(self._parsers[0], text, list(self._resumed), finished=False)

    def add(self, i: int, text: str, token_ids: list[int]) -> None:
        """More of sample ``i``'s output, for ``whole`` at its end."""
        self._texts[i] += text
        self._token_ids[i] += token_ids

    def delta(self, i: int, text: str, token_ids: list[int], finished: bool) -> ParsedDelta | None:
        """Sample ``i``'s next delta (None: the parser holds these tokens back). vLLM's
        thinking-model reasoning parsers keep the start marker's text in the reasoning when it
        arrives with later tokens (a delta holds several tokens when the engine's outputs pile
        up under load), so a marker that opens a delta goes to the parser on its own first."""
        parser = self._parsers[i]
        if parser is None:
            return ParsedDelta(content=text)
        marker = _reasoning_start(parser)
        first = None
        if marker is not None and len(token_ids) > 1 and token_ids[0] == marker[0]:
            if text.startswith(marker[1]):
                first = self._feed(parser, marker[1], token_ids[:1], finished=False)
                text, token_ids = text[len(marker[1]) :], token_ids[1:]
        delta = self._feed(parser, text, token_ids, finished)
        if first is None:
            return _plain_delta(delta)
        if delta is not None:  # both said something (parsers skip a lone marker: not seen)
            first.reasoning = (first.reasoning or "") + (delta.reasoning or "") or None
            first.content = (first.content or "") + (delta.content or "") or None
            first.tool_calls = [*first.tool_calls, *delta.tool_calls]
        return _plain_delta(first)

    def _feed(self, parser: Any, text: str, token_ids: list[int], finished: bool) -> Any:
        """One delta of a sample's output through its parser (vLLM's ``parse_delta``)."""
        return parser.parse_delta(
            delta_text=text,
            delta_token_ids=token_ids,
            request=self._request,
            prompt_token_ids=self._prompt,
            finished=finished,
        )

    def whole(self, i: int) -> ParsedMessage:
        """Sample ``i``'s whole message, from what ``add`` gathered."""
        from vllm.renderers.chat_utils import make_tool_call_id

        parser = self._parsers[i]
        if parser is None:
            return ParsedMessage(content=self._texts[i])
        parser.set_prompt_token_ids(self._prompt)
        reasoning, content, calls = parser.parse(
            self._texts[i],
            self._request,
            enable_auto_tools=self._enable_auto_tools,
            model_output_token_ids=self._token_ids[i],
        )
        choice = self._request.tool_choice
        # After validation a named choice is vLLM's ChatCompletionNamedToolChoiceParam.
        forced = choice == "required" or hasattr(choice, "function")
        if forced and not (calls and all(self._follows_schema(c) for c in calls)):
            # No call a caller can run (cut off, or none found): the text, not an empty answer.
            calls = []
            if not content:
                content = _content_after_reasoning(parser, self._texts[i], self._request)
        if forced:
            content = content or ""  # vLLM's server: "" rather than null for forced calls
        found: tuple[ParsedCall, ...] = ()
        if forced or (self._enable_auto_tools and self._request.tools and choice == "auto"):
            found = tuple(
                ParsedCall(call.id or make_tool_call_id(), call.name, call.arguments)
                for call in calls or []
            )
        return ParsedMessage(content=content, reasoning=reasoning, tool_calls=found)

    def _follows_schema(self, call: Any) -> bool:
        """Whether a forced call names an offered tool and its arguments are a JSON object that
        its tool's parameters schema accepts."""
        from jsonschema import ValidationError as SchemaMismatch
        from jsonschema.validators import validator_for

        tools = {tool.function.name: tool.function for tool in self._request.tools or []}
        function = tools.get(call.name)
        if function is None:
            return False
        try:
            arguments = json.loads(call.arguments)
        except (json.JSONDecodeError, TypeError):
            return False
        if not isinstance(arguments, dict):
            return False
        schema = function.parameters
        if not schema:
            return True
        try:
            validator_for(schema)(schema).validate(arguments)
        except SchemaMismatch:
            return False
        return True


def _content_after_reasoning(parser: Any, text: str, request: Any) -> str:
    """The part of a sample's text that is not reasoning (all of it without a reasoning
    parser)."""
    extract = getattr(parser, "extract_reasoning", None)
    if extract is None:
        return text
    _, content = extract(text, request)
    return content or ""


def _reasoning_start(parser: Any) -> tuple[int, str] | None:
    """The reasoning parser's start marker (token id, text), where it has one."""
    reasoning = getattr(parser, "_reasoning_parser", None)
    token_id = getattr(reasoning, "start_token_id", None)
    token = getattr(reasoning, "start_token", None)
    if isinstance(token_id, int) and isinstance(token, str) and token:
        return token_id, token
    return None


def _plain_delta(delta: Any) -> ParsedDelta | None:
    """vLLM's ``DeltaMessage`` as plain values (None stays None: nothing to send)."""
    if delta is None:
        return None
    pieces = [
        ToolCallPiece(
            index=call.index,
            id=call.id,
            type=call.type,
            name=call.function.name if call.function is not None else None,
            arguments=call.function.arguments if call.function is not None else None,
        )
        for call in delta.tool_calls
    ]
    return ParsedDelta(
        content=delta.content,
        content_null=delta.content is None and "content" in delta.model_fields_set,
        reasoning=delta.reasoning,
        tool_calls=pieces,
    )
