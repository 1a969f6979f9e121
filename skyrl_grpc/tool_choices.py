"""Tool-choice modes: the one table between the contract's ``ToolChoiceMode`` and OpenAI's
names for it ("none", "auto", "required").

The router's HTTP edge and the trainer client read the names into the enum with it; the engine
server writes the enum back as the name vLLM's request takes.
"""

from __future__ import annotations

from skyrl_grpc.v1 import chat_tools_pb2

BY_NAME: dict[str, chat_tools_pb2.ToolChoiceMode] = {
    "none": chat_tools_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": chat_tools_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": chat_tools_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
BY_PROTO: dict[int, str] = {proto: name for name, proto in BY_NAME.items()}
