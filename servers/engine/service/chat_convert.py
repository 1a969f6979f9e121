"""Chat messages, tools and parsed outputs between the contract and the domain's
``chat_parsing``: tools checked and written as OpenAI's API writes them, a ``ChatOutput`` as a
``ChatRequestSpec``, vLLM's adjustments put into the request's ``SamplingParams``, and each
parsed delta or whole message onto its stream message."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from servers.engine.domain.chat_output import ChatOutputParsing, ParsedDelta, ParsedMessage
from servers.engine.domain.chat_parsing import ChatRequestSpec, SamplingAdjustments, ToolChoice
from servers.engine.service.data_convert import structured_outputs_params
from skyrl_grpc import tool_choices
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.v1 import chat_tools_pb2 as tools_pb2
from skyrl_grpc.v1 import data_plane_pb2, generation_pb2

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


def tool_choice(use: tools_pb2.ToolUse) -> ToolChoice:
    """OpenAI's ``tool_choice`` for the contract's (None: unset)."""
    choice = use.tool_choice
    which = choice.WhichOneof("choice")
    if which == "function_name":
        return {"type": "function", "function": {"name": choice.function_name}}
    if which == "mode" and choice.mode in tool_choices.BY_PROTO:
        return tool_choices.BY_PROTO[choice.mode]
    return None


def chat_spec(
    chat: tools_pb2.ChatOutput, sampling: generation_pb2.SamplingParams
) -> ChatRequestSpec:
    """What a chat generation asks of the parsers."""
    use = chat.tool_use
    return ChatRequestSpec(
        tools=tool_dicts(use.tools) if use.tools else [],
        choice=tool_choice(use),
        parallel_tool_calls=(
            use.parallel_tool_calls if use.HasField("parallel_tool_calls") else None
        ),
        structured_outputs=(
            structured_outputs_params(sampling.structured_output)
            if sampling.HasField("structured_output")
            else None
        ),
        resumed_tokens=chat.resumed_tokens,
        whole_messages=chat.whole_messages,
    )


def adjusted(
    sampling: generation_pb2.SamplingParams, adjustments: SamplingAdjustments
) -> generation_pb2.SamplingParams:
    """``sampling`` with what vLLM's rules changed: a constraint, special tokens."""
    if adjustments == SamplingAdjustments():
        return sampling
    sampling = generation_pb2.SamplingParams.FromString(sampling.SerializeToString())
    if adjustments.json_schema is not None:
        sampling.structured_output.json_schema = adjustments.json_schema
    elif adjustments.structural_tag is not None:
        sampling.structured_output.structural_tag = adjustments.structural_tag
    if adjustments.skip_special_tokens is not None:
        sampling.skip_special_tokens = adjustments.skip_special_tokens
    return sampling


def annotate(parsing: ChatOutputParsing, message: data_plane_pb2.GenerateStreamResponse) -> None:
    """Adds the parsed delta (or, at a sample's end, the whole message) to ``message``."""
    i = message.sample_index
    finished = message.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
    if parsing.whole_messages:
        parsing.add(i, message.text, list(message.token_ids))
        if finished:
            message.chat_message.CopyFrom(message_to_proto(parsing.whole(i)))
        return
    delta = parsing.delta(i, message.text, list(message.token_ids), finished)
    if delta is not None:
        message.chat_delta.CopyFrom(delta_to_proto(delta))


def message_to_proto(parsed: ParsedMessage) -> tools_pb2.ChatMessageOut:
    out = tools_pb2.ChatMessageOut()
    if parsed.content is not None:
        out.content = parsed.content
    if parsed.reasoning is not None:
        out.reasoning = parsed.reasoning
    for call in parsed.tool_calls:
        out.tool_calls.add(id=call.id, name=call.name, arguments_json=call.arguments)
    return out


def delta_to_proto(delta: ParsedDelta) -> tools_pb2.ChatDelta:
    out = tools_pb2.ChatDelta()
    if delta.content is not None:
        out.content = delta.content
    elif delta.content_null:
        out.content_null = True
    if delta.reasoning is not None:
        out.reasoning = delta.reasoning
    for call in delta.tool_calls:
        piece = out.tool_calls.add(index=call.index)
        if call.id is not None:
            piece.id = call.id
        if call.type is not None:
            piece.type = call.type
        if call.name is not None:
            piece.name = call.name
        if call.arguments is not None:
            piece.arguments = call.arguments
    return out


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
