"""Tools for ``chat``: the functions a model may call, how it must choose, and the assistant
message the servers parsed out of its output (tool calls, reasoning, content) -- typed, with
OpenAI-shaped dicts accepted wherever a harness already has them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from skyrl_grpc import tool_choices
from skyrl_grpc.v1 import chat_tools_pb2, data_plane_pb2


@dataclass(frozen=True)
class Tool:
    """A function the model may call; ``parameters`` is its JSON Schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None
    # OpenAI's ``strict``: arguments held to ``parameters`` exactly (constrained decoding).
    strict: bool | None = None

    @classmethod
    def of(cls, tool: Tool | Mapping[str, Any]) -> Tool:
        """A ``Tool``, or OpenAI's ``{"type": "function", "function": {...}}``."""
        if isinstance(tool, Tool):
            return tool
        function = tool.get("function", tool)
        return cls(
            name=function["name"],
            description=function.get("description") or "",
            parameters=function.get("parameters"),
            strict=function.get("strict"),
        )

    def to_proto(self) -> chat_tools_pb2.Tool:
        out = chat_tools_pb2.Tool(name=self.name, description=self.description)
        if self.parameters is not None:
            out.parameters_json = json.dumps(dict(self.parameters))
        if self.strict is not None:
            out.strict = self.strict
        return out


@dataclass(frozen=True)
class CallFunction:
    """A tool choice that makes the model call this function."""

    name: str


# none / auto / required, or one function.
ToolChoice = Literal["none", "auto", "required"] | CallFunction


def tool_use(
    tools: Sequence[Tool | Mapping[str, Any]],
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
) -> chat_tools_pb2.ToolUse:
    """The contract's ``ToolUse`` for ``chat``'s arguments."""
    use = chat_tools_pb2.ToolUse(tools=[Tool.of(t).to_proto() for t in tools])
    if isinstance(tool_choice, CallFunction):
        use.tool_choice.function_name = tool_choice.name
    elif tool_choice is not None:
        if tool_choice not in tool_choices.BY_NAME:
            raise ValueError(
                f"tool_choice {tool_choice!r}: use none, auto, required or CallFunction"
            )
        use.tool_choice.mode = tool_choices.BY_NAME[tool_choice]
    if parallel_tool_calls is not None:
        use.parallel_tool_calls = parallel_tool_calls
    return use


@dataclass(frozen=True)
class ToolCall:
    """A call the model made; ``arguments`` is the JSON text it wrote."""

    id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class AssistantMessage:
    """A chat sample's output as the servers parsed it."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def from_proto(cls, message: chat_tools_pb2.ChatMessageOut) -> AssistantMessage:
        return cls(
            content=message.content if message.HasField("content") else None,
            reasoning=message.reasoning if message.HasField("reasoning") else None,
            tool_calls=[ToolCall(c.id, c.name, c.arguments_json) for c in message.tool_calls],
        )

    def as_message(self) -> dict[str, Any]:
        """The message to append to the conversation for its next turn (OpenAI's shape)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.tool_calls
            ]
        return out


def chat_message(
    message: Mapping[str, Any] | data_plane_pb2.ChatMessage,
) -> data_plane_pb2.ChatMessage:
    """A message of the conversation: the contract's, or OpenAI's dict (with ``tool_calls`` on
    an assistant turn, ``tool_call_id`` on a tool's answer)."""
    if isinstance(message, data_plane_pb2.ChatMessage):
        return message
    out = data_plane_pb2.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        tool_call_id=message.get("tool_call_id") or "",
        name=message.get("name") or "",
    )
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments", "{}")
        out.tool_calls.add(
            id=call.get("id") or "",
            name=function["name"],
            arguments_json=arguments if isinstance(arguments, str) else json.dumps(arguments),
        )
    return out
