"""The parsing of a chat generation's samples by vLLM's parsers (built by ``chat_parsing``'s
``ChatParsers.prepare``; every call into vLLM is ``vllm_adapter.chat_parser_calls``'): each
streamed message's delta, or each sample's whole message at its end, as plain values: content,
reasoning and tool calls (with the rule for forced choices: calls that follow their tools'
schemas, or the text).

A forced choice's calls are given out whole, each as soon as it is complete (its arguments a
JSON object its tool's schema accepts: ``CompleteCalls``), streamed or not: a sample cut off by
``max_tokens`` after some complete calls returns those (its finish reason says more was cut),
the cut remainder nowhere; one with no complete call returns its generated text as content.
vLLM's server streams a forced call's arguments as they are generated and, at a cut-off,
returns none of the calls, only the text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from servers.engine.vllm_adapter.chat_parser_calls import (
    DeltaValues,
    ParsedRequest,
    SampleParser,
    new_call_id,
)
from skyrl_grpc.partial_characters import held_back


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


class CompleteCalls:
    """One sample's forced calls as they complete: the parser's pieces folded per call, a call
    given out (once, whole) when its arguments are a JSON object that ``follows(name,
    arguments)`` accepts and every call before it was given out (calls are generated in
    order: one not complete is the one being generated, or cut)."""

    def __init__(self, follows: Callable[[str, str], bool]) -> None:
        self._follows = follows
        self._folded: dict[int, ToolCallPiece] = {}
        self.given: list[ToolCallPiece] = []

    def fold(self, pieces: list[ToolCallPiece]) -> list[ToolCallPiece]:
        """Adds the parser's pieces; the calls they completed, each as one whole piece."""
        for piece in pieces:
            into = self._folded.setdefault(piece.index, ToolCallPiece(piece.index, arguments=""))
            into.id = into.id or piece.id
            into.type = into.type or piece.type
            into.name = (into.name or "") + (piece.name or "") or None
            into.arguments = (into.arguments or "") + (piece.arguments or "")
        completed = []
        for index in sorted(self._folded)[len(self.given) :]:
            call = self._folded[index]
            if call.name is None or not self._follows(call.name, call.arguments or ""):
                break
            whole = ToolCallPiece(
                index, call.id, call.type or "function", call.name, call.arguments
            )
            self.given.append(whole)
            completed.append(whole)
        return completed

    def calls(self, new_id: Callable[[], str]) -> tuple[ParsedCall, ...]:
        """The calls given out, as a whole message's."""
        return tuple(
            ParsedCall(call.id or new_id(), call.name or "", call.arguments or "")
            for call in self.given
        )


@dataclass(frozen=True)
class ParsedMessage:
    """A sample's whole assistant message."""

    content: str | None
    reasoning: str | None = None
    tool_calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True)
class SampleParsers:
    """A request's parsers (``vllm_adapter.chat_parser_calls``): the request as vLLM's rules
    left it, one parser per sample, and a maker of a fresh one."""

    request: ParsedRequest
    parsers: list[SampleParser]
    new_parser: Callable[[], SampleParser]


class ChatOutputParsing:
    """One request's samples parsed as they stream (``delta``) or once each sample ends
    (``whole``); without parsers (``samples`` None) its text is all content."""

    def __init__(
        self,
        samples: SampleParsers | None,
        prompt_token_ids: list[int],
        resumed: int,
        whole_messages: bool,
        n: int = 1,
    ) -> None:
        self._samples = samples
        self._parsers: list[SampleParser | None] = (
            list(samples.parsers) if samples is not None else [None] * n
        )
        n = len(self._parsers)
        self.whole_messages = whole_messages
        self._texts = [""] * n
        self._token_ids: list[list[int]] = [[] for _ in range(n)]
        # ``resumed``: tokens at the end of the prompt that are the sample's output so far.
        self._resumed = prompt_token_ids[len(prompt_token_ids) - resumed :] if resumed else []
        self._forced = samples is not None and samples.request.forced
        # A forced choice's calls as they complete, per sample; with whole messages, each
        # sample's steps (text, token ids) too, replayed through a fresh parser's streaming
        # parse when the whole parse finds no calls a caller can run (a cut-off).
        self._complete = [CompleteCalls(self._follows_schema) for _ in range(n)]
        self._steps: list[list[tuple[str, list[int]]]] = [[] for _ in range(n)]
        # Content streamed so far, per sample (a forced sample without a complete call ends
        # with the rest of its text as content).
        self._content_sent = [""] * n

    def resume(self, decode: Callable[[list[int]], str]) -> None:
        """Reads the sample's output so far (``resumed_tokens``) into its parser; what it
        yields was sent before, by the server that generated it. Its text is what was given
        out before the cut: tokens holding part of a character gave out none (the engine's
        text of the continuation begins with that character)."""
        if not self._resumed:
            return
        held = held_back(decode, self._resumed)
        text = decode(self._resumed[: len(self._resumed) - held])
        parser = self._parsers[0]
        if self.whole_messages or parser is None:
            self._texts[0], self._token_ids[0] = text, list(self._resumed)
            if self._forced:
                self._steps[0].append((text, list(self._resumed)))
            return
        said = _plain_delta(parser.delta(text, list(self._resumed), False))
        self._texts[0] = text
        if said is not None:
            self._content_sent[0] += said.content or ""
            self._complete[0].fold(said.tool_calls)  # given out by the server before

    def add(self, i: int, text: str, token_ids: list[int]) -> None:
        """More of sample ``i``'s output, for ``whole`` at its end."""
        self._texts[i] += text
        self._token_ids[i] += token_ids
        if self._forced:
            self._steps[i].append((text, token_ids))

    def delta(self, i: int, text: str, token_ids: list[int], finished: bool) -> ParsedDelta | None:
        """Sample ``i``'s next delta (None: the parser holds these tokens back). A forced
        choice's calls go out whole as each completes (``CompleteCalls``); at the end of a
        sample with none, the rest of its text goes out as content."""
        parsed = self._parsed_delta(i, text, token_ids, finished)
        if not self._forced:
            return parsed
        self._texts[i] += text
        if parsed is not None:
            self._content_sent[i] += parsed.content or ""
            parsed.tool_calls = self._complete[i].fold(parsed.tool_calls)
        if finished and not self._complete[i].given:
            rest = self._uncalled_content(i).removeprefix(self._content_sent[i])
            parsed = parsed or ParsedDelta()
            parsed.content = (parsed.content or "") + rest
        if parsed is not None and not (parsed.tool_calls or parsed.content or parsed.reasoning):
            return None  # what it said was a call's piece, held back until the call completes
        return parsed

    def _parsed_delta(
        self, i: int, text: str, token_ids: list[int], finished: bool
    ) -> ParsedDelta | None:
        """Sample ``i``'s next delta as its parser reads it. vLLM's thinking-model reasoning
        parsers keep the start marker's text in the reasoning when it arrives with later
        tokens (a delta holds several tokens when the engine's outputs pile up under load), so
        a marker that opens a delta goes to the parser on its own first."""
        parser = self._parsers[i]
        if parser is None:
            return ParsedDelta(content=text)
        marker = parser.reasoning_start()
        first = None
        if marker is not None and len(token_ids) > 1 and token_ids[0] == marker[0]:
            if text.startswith(marker[1]):
                first = _plain_delta(parser.delta(marker[1], token_ids[:1], False))
                text, token_ids = text[len(marker[1]) :], token_ids[1:]
        delta = _plain_delta(parser.delta(text, token_ids, finished))
        if first is None:
            return delta
        if delta is not None:  # both said something (parsers skip a lone marker: not seen)
            first.reasoning = (first.reasoning or "") + (delta.reasoning or "") or None
            first.content = (first.content or "") + (delta.content or "") or None
            first.tool_calls = [*first.tool_calls, *delta.tool_calls]
        return first

    def _uncalled_content(self, i: int) -> str:
        """A forced sample's text that is not reasoning: its content when no call completed."""
        parser = self._parsers[i]
        text = self._texts[i]
        return parser.content_after_reasoning(text) if parser is not None else text

    def whole(self, i: int) -> ParsedMessage:
        """Sample ``i``'s whole message, from what ``add`` gathered."""
        parser, samples = self._parsers[i], self._samples
        if parser is None or samples is None:
            return ParsedMessage(content=self._texts[i])
        reasoning, content, calls = parser.whole(self._texts[i], self._token_ids[i])
        found: tuple[ParsedCall, ...] = ()
        if self._forced:
            if calls and all(self._follows_schema(c.name, c.arguments) for c in calls):
                found = tuple(ParsedCall(c.id or new_call_id(), c.name, c.arguments) for c in calls)
            else:  # cut off (or none found): the calls that were complete, else the text
                found = self._replayed(i).calls(new_call_id)
                content = "" if found else content or self._uncalled_content(i)
            content = content or ""  # vLLM's server: "" rather than null for forced calls
        elif samples.request.auto_tools:
            found = tuple(ParsedCall(c.id or new_call_id(), c.name, c.arguments) for c in calls)
        return ParsedMessage(content=content, reasoning=reasoning, tool_calls=found)

    def _replayed(self, i: int) -> CompleteCalls:
        """Sample ``i``'s steps through a fresh parser's streaming parse, as a stream of it
        would have gone: the forced calls it completed."""
        complete = CompleteCalls(self._follows_schema)
        if self._samples is None:
            return complete
        parser, steps = self._samples.new_parser(), self._steps[i]
        for step, (text, token_ids) in enumerate(steps):
            said = _plain_delta(parser.delta(text, token_ids, step == len(steps) - 1))
            if said is not None:
                complete.fold(said.tool_calls)
        return complete

    def _follows_schema(self, name: str, arguments_json: str) -> bool:
        """Whether a forced call names an offered tool and its arguments are a JSON object that
        its tool's parameters schema accepts."""
        from jsonschema import ValidationError as SchemaMismatch
        from jsonschema.validators import validator_for

        schemas = self._samples.request.schemas if self._samples is not None else {}
        if name not in schemas:
            return False
        try:
            arguments = json.loads(arguments_json)
        except (json.JSONDecodeError, TypeError):
            return False
        if not isinstance(arguments, dict):
            return False
        schema = schemas[name]
        if not schema:
            return True
        try:
            validator_for(schema)(schema).validate(arguments)
        except SchemaMismatch:
            return False
        return True


def _plain_delta(delta: DeltaValues | None) -> ParsedDelta | None:
    """A parser's delta as this module's (None stays None: nothing to send)."""
    if delta is None:
        return None
    pieces = [ToolCallPiece(p.index, p.id, p.type, p.name, p.arguments) for p in delta.calls]
    return ParsedDelta(
        content=delta.content,
        content_null=delta.content_null,
        reasoning=delta.reasoning,
        tool_calls=pieces,
    )
