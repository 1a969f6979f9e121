"""The rule a forced tool choice's answer keeps, whatever the model wrote: a caller told
"tool_calls" gets calls, every call follows its tool's JSON Schema, and an answer with no call
(cut off by ``max_tokens``, or none found) keeps its generated text as ``content``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

# Two tools whose string arguments are free: a random model's calls run long, so seeded
# requests at a small max_tokens end both ways, some cut off, some whole.
OPEN_SCHEMAS: dict[str, Any] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "get_time": {
        "type": "object",
        "properties": {"zone": {"type": "string"}},
        "required": ["zone"],
    },
}
OPEN_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
    for name, schema in OPEN_SCHEMAS.items()
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SEEDS = range(12)


def forced_request(choice: Any, seed: int) -> dict[str, Any]:
    """The issue's request: two tools, a forced choice, seeded sampling, 120 tokens."""
    return {
        "model": "",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": OPEN_TOOLS,
        "tool_choice": choice,
        "max_tokens": 120,
        "temperature": 0.7,
        "seed": seed,
    }


def broken_forced_answers(choice: Any, answers: list[dict[str, Any]]) -> list[str]:
    """What breaks the rule in ``answers`` (chat completions as JSON, one per seed)."""
    broken = []
    for seed, answer in enumerate(answers):
        (first,) = answer["choices"]
        message, finish = first["message"], first["finish_reason"]
        calls = message.get("tool_calls") or []
        where = f"seed {seed} ({finish}, {answer['usage']['completion_tokens']} tokens)"
        if finish == "tool_calls" and not calls:
            broken.append(f"{where}: finish_reason tool_calls with no call")
        if not calls and not message.get("content"):
            broken.append(f"{where}: no call and no content: the generated text is lost")
        for call in calls:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            if isinstance(choice, dict) and name != choice["function"]["name"]:
                broken.append(f"{where}: a call to {name}, not the named function")
                continue
            try:
                jsonschema.validate(json.loads(arguments), OPEN_SCHEMAS[name])
            except (ValueError, KeyError, jsonschema.ValidationError) as exc:
                broken.append(f"{where}: {name}({arguments[:60]!r}) breaks its schema: {exc!r}")
    return broken
