"""Tool calling through the OpenAI edge: ``tools``, ``tool_choice`` and ``parallel_tool_calls``
read into the contract's ``ToolUse``; the engine's parsed messages and deltas written back in
OpenAI's shapes, with ``finish_reason: "tool_calls"`` where vLLM's server gives it.

The parsing itself is the engine's (``servers.engine.domain.chat_parsing``, vLLM's parsers): this
module only translates.
"""

from __future__ import annotations

import json
from typing import Any

from skyrl_grpc import tool_choices
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.v1 import chat_tools_pb2 as tools_pb2
from skyrl_grpc.v1 import data_plane_pb2

Json = dict[str, Any]


def read_tool_use(body: Json) -> tools_pb2.ToolUse:
    """The request's tools and how the model must use them (empty when it offers none)."""
    use = tools_pb2.ToolUse()
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidArgument("'tools' must be a list of {'type': 'function', ...}")
        for i, tool in enumerate(tools):
            use.tools.append(_tool(tool, i))
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        if choice not in tool_choices.BY_NAME:
            raise InvalidArgument(
                f"'tool_choice' {choice!r}: use none, auto, required or "
                "{'type': 'function', 'function': {'name': ...}}"
            )
        use.tool_choice.mode = tool_choices.BY_NAME[choice]
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidArgument("'tool_choice.function.name' must name one of the tools")
        use.tool_choice.function_name = name
    elif choice is not None:
        raise InvalidArgument("'tool_choice' must be a string or an object")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise InvalidArgument("'parallel_tool_calls' must be a boolean")
        use.parallel_tool_calls = parallel
    return use


def _tool(raw: Any, index: int) -> tools_pb2.Tool:
    where = f"'tools[{index}]'"
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise InvalidArgument(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
    function = raw.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidArgument(f"{where}.function must be an object with a 'name'")
    tool = tools_pb2.Tool(name=function["name"], description=str(function.get("description") or ""))
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise InvalidArgument(f"{where}.function.parameters must be a JSON Schema object")
        tool.parameters_json = json.dumps(parameters)
    strict = function.get("strict")
    if isinstance(strict, bool):
        tool.strict = strict
    return tool


def read_message_tools(raw: Json, index: int, message: data_plane_pb2.ChatMessage) -> None:
    """An earlier turn's tool calls (assistant) or the call a tool message answers."""
    calls = raw.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise InvalidArgument(f"'messages[{index}].tool_calls' must be a list")
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InvalidArgument(
                    f"'messages[{index}].tool_calls[{j}]' must have a function with a 'name'"
                )
            arguments = function.get("arguments", "{}")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            message.tool_calls.add(
                id=str(call.get("id") or ""), name=function["name"], arguments_json=arguments
            )
    for key in ("tool_call_id", "name"):
        value = raw.get(key)
        if isinstance(value, str):
            setattr(message, key, value)


def forced_function(use: tools_pb2.ToolUse) -> str | None:
    """The function a named tool choice forces, if any."""
    if use.tool_choice.WhichOneof("choice") == "function_name":
        return use.tool_choice.function_name
    return None


def _choice(use: tools_pb2.ToolUse) -> str:
    which = use.tool_choice.WhichOneof("choice")
    if which == "function_name":
        return "named"
    if which == "mode" and use.tool_choice.mode != tools_pb2.TOOL_CHOICE_MODE_UNSPECIFIED:
        return tool_choices.BY_PROTO[use.tool_choice.mode]
    return "auto" if use.tools else "none"


def message_fields(message: tools_pb2.ChatMessageOut) -> Json:
    """A whole answer's ``content``, ``reasoning`` and ``tool_calls``."""
    out: Json = {
        "content": message.content if message.HasField("content") else None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_json},
            }
            for call in message.tool_calls
        ],
    }
    if message.HasField("reasoning"):
        out["reasoning"] = message.reasoning
    return out


def whole_finish_reason(
    use: tools_pb2.ToolUse, message: tools_pb2.ChatMessageOut, finish: str | None
) -> str | None:
    """vLLM's rule for a whole answer: "tool_calls" when auto found calls, or a required choice
    stopped by itself; a named choice keeps "stop". Unlike vLLM's server, never "tool_calls"
    for an answer with no calls (the engine returns a forced answer's text, not a call, when it
    found no call that follows its tool's schema)."""
    choice = _choice(use)
    if message.tool_calls and (choice == "auto" or (choice == "required" and finish == "stop")):
        return "tool_calls"
    return finish


def streamed_finish_reason(
    use: tools_pb2.ToolUse, tools_streamed: bool, finish: str | None
) -> str | None:
    """vLLM's rule for a stream: "tool_calls" when calls were streamed and the sample stopped
    by itself, unless a named choice forced them."""
    if tools_streamed and forced_function(use) is None and finish == "stop":
        return "tool_calls"
    return finish


def delta_fields(delta: tools_pb2.ChatDelta) -> Json:
    """A streamed delta's fields, only those the parser set (as vLLM writes its deltas)."""
    out: Json = {}
    if delta.HasField("content") or delta.content_null:
        out["content"] = delta.content if delta.HasField("content") else None
    if delta.HasField("reasoning"):
        out["reasoning"] = delta.reasoning
    calls = []
    for piece in delta.tool_calls:
        call: Json = {}
        if piece.HasField("id"):
            call["id"] = piece.id
        if piece.HasField("type"):
            call["type"] = piece.type
        call["index"] = piece.index
        function: Json = {}
        if piece.HasField("name"):
            function["name"] = piece.name
        if piece.HasField("arguments"):
            function["arguments"] = piece.arguments
        if function:
            call["function"] = function
        calls.append(call)
    if calls:
        out["tool_calls"] = calls
    return out
