"""Chat outputs as assistant messages: tool calls, reasoning and content, found by vLLM's own
parsers under vLLM's own request rules.

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
- a whole answer's calls are returned only when each one's arguments are a JSON object that
  follows its tool's schema; otherwise (a call cut off by ``max_tokens``, or none found) the
  answer carries no calls and its generated text as ``content``, as vLLM's server does for a
  cut-off under a parser.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from skyrl_grpc import tool_choices
from skyrl_grpc.errors import FailedPrecondition, InvalidArgument
from skyrl_grpc.v1 import chat_tools_pb2 as tools_pb2
from skyrl_grpc.v1 import data_plane_pb2, generation_pb2

from .convert import structured_outputs_params

# Tool definitions are JSON the template renders and, for required / named choices, a grammar
# the engine compiles: bounded below the engine's constraint limit
# (validate.MAX_CONSTRAINT_BYTES), which the constraint derived from them must pass too.
MAX_TOOLS_BYTES = 32 * 1024


def tool_dicts(tools: Sequence[tools_pb2.Tool]) -> list[dict[str, Any]]:
    """The tools as OpenAI's API writes them, checked: what templates and vLLM's parsers take."""
    size = sum(len(t.name) + len(t.description) + len(t.parameters_json) for t in tools)
    if size > MAX_TOOLS_BYTES:
        raise InvalidArgument(
            f"tools: {size} bytes of names, descriptions and schemas, over {MAX_TOOLS_BYTES}"
        )
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}] ({tool.name!r})"
        if not tool.name:
            raise InvalidArgument(f"tools[{i}]: a function needs a name")
        if tool.name in seen:
            raise InvalidArgument(f"{where}: two tools have this name")
        seen.add(tool.name)
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters_json:
            try:
                schema = json.loads(tool.parameters_json)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{where}: parameters is not JSON: {exc}") from exc
            if not isinstance(schema, dict):
                raise InvalidArgument(f"{where}: parameters must be a JSON Schema object")
            try:
                validator_for(schema).check_schema(schema)
            except SchemaError as exc:
                raise InvalidArgument(
                    f"{where}: parameters is not a valid JSON Schema: {exc.message}"
                ) from exc
            function["parameters"] = schema
        if tool.HasField("strict"):
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def tool_choice(use: tools_pb2.ToolUse) -> str | dict[str, Any] | None:
    """OpenAI's ``tool_choice`` for the contract's."""
    choice = use.tool_choice
    which = choice.WhichOneof("choice")
    if which == "function_name":
        return {"type": "function", "function": {"name": choice.function_name}}
    if which == "mode" and choice.mode in tool_choices.BY_PROTO:
        return tool_choices.BY_PROTO[choice.mode]
    return None


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
        self,
        chat: tools_pb2.ChatOutput,
        sampling: generation_pb2.SamplingParams,
        prompt_token_ids: list[int],
        n: int,
    ) -> tuple[generation_pb2.SamplingParams, ChatOutputParsing]:
        """The sampling parameters vLLM's server would use for this chat request (a required or
        named tool choice constrains the output) and the parsing of its samples."""
        use = chat.tool_use
        if chat.resumed_tokens and (n != 1 or chat.resumed_tokens >= len(prompt_token_ids)):
            raise InvalidArgument(
                "chat_output.resumed_tokens: a resumed generation has one sample and a prompt "
                "longer than its tokens so far"
            )
        offered = bool(use.tools) or use.HasField("tool_choice")
        if self._parser_cls is None and not offered:  # plain content: nothing to decide
            return sampling, ChatOutputParsing([None] * n, None, prompt_token_ids, chat, False)
        choice = tool_choice(use) if offered else None
        if choice is not None and not use.tools:
            raise InvalidArgument("tool_use.tool_choice: offer tools to choose from")
        names = [tool.name for tool in use.tools]
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise InvalidArgument(
                f"tool_choice names function {choice['function']['name']!r}, which is not "
                f"among the tools offered: {', '.join(names)}"
            )
        if isinstance(choice, dict) and sampling.HasField("structured_output"):
            raise InvalidArgument(
                "a named tool_choice constrains the output to that function's arguments: "
                "drop sampling_params.structured_output (or use tool_choice auto)"
            )
        request = self._request(use, choice, sampling)
        self._check_supported(request)
        parser_cls = self._parser_for(request.tool_choice)
        if parser_cls is None:
            return sampling, ChatOutputParsing([None] * n, request, prompt_token_ids, chat, False)
        parsers = [parser_cls(self.tokenizer, request.tools) for _ in range(n)]
        # vLLM's rule: the parser adjusts the request (a JSON schema for required / named
        # choices, special tokens kept for markers that are special tokens).
        adjusted = parsers[0].adjust_request(request.model_copy(deep=True))
        sampling = _with_adjustments(sampling, request, adjusted)
        return sampling, ChatOutputParsing(
            parsers, adjusted, prompt_token_ids, chat, self.enable_auto_tool_choice
        )

    def _request(
        self,
        use: tools_pb2.ToolUse,
        choice: str | dict[str, Any] | None,
        sampling: generation_pb2.SamplingParams,
    ) -> Any:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMValidationError

        body: dict[str, Any] = {"model": self.model_name, "messages": []}
        if use.tools:
            body["tools"] = tool_dicts(use.tools)
            if choice == "required" or isinstance(choice, dict):
                # A forced call's arguments follow its tool's schema, parser or not.
                for tool in body["tools"]:
                    tool["function"]["strict"] = True
        if choice is not None:
            body["tool_choice"] = choice
        if use.HasField("parallel_tool_calls"):
            body["parallel_tool_calls"] = use.parallel_tool_calls
        if sampling.HasField("structured_output"):
            # The caller's constraint, for the parser to combine with the calls' (auto).
            body["structured_outputs"] = structured_outputs_params(sampling.structured_output)
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


class ChatOutputParsing:
    """One request's samples parsed as they stream (``ChatDelta`` on each message) or once each
    sample ends (``ChatMessageOut`` on its last message)."""

    def __init__(
        self,
        parsers: list[Any],
        request: Any,
        prompt_token_ids: list[int],
        chat: tools_pb2.ChatOutput,
        enable_auto_tools: bool,
    ) -> None:
        # None for each sample where no parser is configured: its text is all content.
        self._parsers = parsers
        self._request = request
        resumed = chat.resumed_tokens
        self._prompt = prompt_token_ids[: len(prompt_token_ids) - resumed]
        self._whole = chat.whole_messages
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
        if self._whole or self._parsers[0] is None:
            self._texts[0], self._token_ids[0] = text, list(self._resumed)
            return
        self._feed(self._parsers[0], text, list(self._resumed), finished=False)

    def annotate(self, message: data_plane_pb2.GenerateStreamResponse) -> None:
        """Adds the parsed delta (or, at a sample's end, the whole message) to ``message``."""
        i = message.sample_index
        finished = message.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
        if self._whole:
            self._texts[i] += message.text
            self._token_ids[i] += message.token_ids
            if finished:
                message.chat_message.CopyFrom(self._parse_whole(i))
            return
        if self._parsers[i] is None:
            message.chat_delta.content = message.text
            return
        delta = self._parse_delta(i, message.text, list(message.token_ids), finished)
        if delta is not None:
            message.chat_delta.CopyFrom(_delta_to_proto(delta))

    def _parse_delta(self, i: int, text: str, token_ids: list[int], finished: bool) -> Any:
        """Sample ``i``'s next delta through its parser. vLLM's thinking-model reasoning parsers
        keep the start marker's text in the reasoning when it arrives with later tokens (a
        delta holds several tokens when the engine's outputs pile up under load), so a marker
        that opens a delta goes to the parser on its own first."""
        parser = self._parsers[i]
        marker = _reasoning_start(parser)
        first = None
        if marker is not None and len(token_ids) > 1 and token_ids[0] == marker[0]:
            if text.startswith(marker[1]):
                first = self._feed(parser, marker[1], token_ids[:1], finished=False)
                text, token_ids = text[len(marker[1]) :], token_ids[1:]
        delta = self._feed(parser, text, token_ids, finished)
        if first is None:
            return delta
        if delta is not None:  # both said something (parsers skip a lone marker: not seen)
            first.reasoning = (first.reasoning or "") + (delta.reasoning or "") or None
            first.content = (first.content or "") + (delta.content or "") or None
            first.tool_calls = [*first.tool_calls, *delta.tool_calls]
        return first

    def _feed(self, parser: Any, text: str, token_ids: list[int], finished: bool) -> Any:
        """One delta of a sample's output through its parser (vLLM's ``parse_delta``)."""
        return parser.parse_delta(
            delta_text=text,
            delta_token_ids=token_ids,
            request=self._request,
            prompt_token_ids=self._prompt,
            finished=finished,
        )

    def _parse_whole(self, i: int) -> tools_pb2.ChatMessageOut:
        from vllm.renderers.chat_utils import make_tool_call_id

        parser = self._parsers[i]
        if parser is None:
            return tools_pb2.ChatMessageOut(content=self._texts[i])
        parser.set_prompt_token_ids(self._prompt)
        reasoning, content, calls = parser.parse(
            self._texts[i],
            self._request,
            enable_auto_tools=self._enable_auto_tools,
            model_output_token_ids=self._token_ids[i],
        )
        out = tools_pb2.ChatMessageOut()
        if reasoning is not None:
            out.reasoning = reasoning
        choice = self._request.tool_choice
        # After validation a named choice is vLLM's ChatCompletionNamedToolChoiceParam.
        forced = choice == "required" or hasattr(choice, "function")
        if forced and not (calls and all(self._follows_schema(c) for c in calls)):
            # No call a caller can run (cut off, or none found): the text, not an empty answer.
            calls = []
            if not content:
                content = _content_after_reasoning(parser, self._texts[i], self._request)
        if forced:
            out.content = content or ""  # vLLM's server: "" rather than null for forced calls
        elif content is not None:
            out.content = content
        if forced or (self._enable_auto_tools and self._request.tools and choice == "auto"):
            for call in calls or []:
                out.tool_calls.add(
                    id=call.id or make_tool_call_id(), name=call.name, arguments_json=call.arguments
                )
        return out

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


def _with_adjustments(
    sampling: generation_pb2.SamplingParams, before: Any, after: Any
) -> generation_pb2.SamplingParams:
    """``sampling`` with what the parser changed on the request: a constraint, special tokens."""
    sampling = generation_pb2.SamplingParams.FromString(sampling.SerializeToString())
    constraint = after.structured_outputs
    if constraint is not None and constraint != before.structured_outputs:
        if constraint.json is not None:
            schema = constraint.json
            sampling.structured_output.json_schema = (
                schema if isinstance(schema, str) else json.dumps(schema)
            )
        elif constraint.structural_tag is not None:
            tag = constraint.structural_tag
            sampling.structured_output.structural_tag = (
                tag if isinstance(tag, str) else json.dumps(tag)
            )
        else:
            raise FailedPrecondition(
                f"the tool-call parser set a constraint the contract lacks: {constraint}"
            )
    if after.skip_special_tokens != before.skip_special_tokens:
        sampling.skip_special_tokens = after.skip_special_tokens
    return sampling


def _reasoning_start(parser: Any) -> tuple[int, str] | None:
    """The reasoning parser's start marker (token id, text), where it has one."""
    reasoning = getattr(parser, "_reasoning_parser", None)
    token_id = getattr(reasoning, "start_token_id", None)
    token = getattr(reasoning, "start_token", None)
    if isinstance(token_id, int) and isinstance(token, str) and token:
        return token_id, token
    return None


def _delta_to_proto(delta: Any) -> tools_pb2.ChatDelta:
    out = tools_pb2.ChatDelta()
    if delta.content is not None:
        out.content = delta.content
    elif "content" in delta.model_fields_set:
        out.content_null = True
    if delta.reasoning is not None:
        out.reasoning = delta.reasoning
    for call in delta.tool_calls:
        piece = out.tool_calls.add(index=call.index)
        if call.id is not None:
            piece.id = call.id
        if call.type is not None:
            piece.type = call.type
        if call.function is not None:
            if call.function.name is not None:
                piece.name = call.function.name
            if call.function.arguments is not None:
                piece.arguments = call.function.arguments
    return out


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        found = errors()
        if found:
            message = str(found[0].get("msg", exc))
            return message.removeprefix("Value error, ")
    return str(exc)


def message_dicts(messages: Sequence[data_plane_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as chat templates take them: a call's arguments as a JSON object, as
    vLLM's server hands them to templates."""
    out = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            calls = []
            for j, call in enumerate(message.tool_calls):
                try:
                    arguments = json.loads(call.arguments_json or "{}")
                except json.JSONDecodeError as exc:
                    raise InvalidArgument(
                        f"messages[{i}].tool_calls[{j}].arguments_json is not JSON: {exc}"
                    ) from exc
                function = {"name": call.name, "arguments": arguments}
                calls.append({"id": call.id, "type": "function", "function": function})
            entry["tool_calls"] = calls
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.name:
            entry["name"] = message.name
        out.append(entry)
    return out
