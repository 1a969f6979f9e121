"""Two OpenAI servers' answers to the same request, compared field by field: what is random or
a clock's (ids, timestamps, fingerprints) set aside, tool-call ids checked for vLLM's shape and
blanked, floats compared to 4 places; a stream compared as what a client folds it into (event
boundaries depend on timing: vLLM's output handler merges what its consumer has not taken yet,
and so does this stack), with the shape of every kind of event compared too.

``DOCUMENTED`` holds the differences left between this stack's edge and vLLM's server, each
with why; docs/serving.md lists the same ("The edge beside vLLM's server")."""

from __future__ import annotations

import re
from typing import Any

Json = dict[str, Any]

VOLATILE = frozenset({"id", "created", "system_fingerprint"})
CALL_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16,}$")
# A difference's path (dots and [index]) -> why it is there.
DOCUMENTED: dict[str, str] = {
    r"\.usage\.prompt_tokens_details$": "the edge reports prompt-cache hits on every answer "
    "(usage.prompt_tokens_details.cached_tokens); vLLM's server only with "
    "--enable-prompt-tokens-details",
    r"\.usage\.completion_tokens_details$": "streamed usage: the edge writes the same five "
    "keys as in a whole answer; vLLM's server writes three",
}


def documented(path: str) -> bool:
    return any(re.search(pattern, path) for pattern in DOCUMENTED)


def normalized(value: Any) -> Any:
    """``value`` without what differs run to run."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in VOLATILE and not (key == "id" and _is_call_id(item)):
                continue
            if key == "id" and _is_call_id(item):
                assert CALL_ID.match(item), item
                item = "<id>"
            out[key] = normalized(item)
        return out
    if isinstance(value, list | tuple):
        return [normalized(v) for v in value]
    if isinstance(value, frozenset):
        return value
    if isinstance(value, float):
        return round(value, 4)
    return value


def _is_call_id(item: Any) -> bool:
    return isinstance(item, str) and item.startswith("chatcmpl-tool")


def differences(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Where ``ours`` and ``theirs`` (normalized) differ, but for ``DOCUMENTED`` paths."""
    if documented(path):
        return []
    if isinstance(ours, dict) and isinstance(theirs, dict):
        found = []
        for key in sorted(set(ours) | set(theirs)):
            where = f"{path}.{key}"
            if key not in ours:
                found += [] if documented(where) else [f"{where}: only vLLM's ({theirs[key]!r})"]
            elif key not in theirs:
                found += [] if documented(where) else [f"{where}: only ours ({ours[key]!r})"]
            else:
                found += differences(ours[key], theirs[key], where)
        return found
    if isinstance(ours, frozenset) and isinstance(theirs, frozenset):
        return [f"{path}: only ours {s}" for s in sorted(ours - theirs)] + [
            f"{path}: only vLLM's {s}" for s in sorted(theirs - ours)
        ]
    if isinstance(ours, list) and isinstance(theirs, list):
        found = (
            [f"{path}: {len(ours)} items, vLLM's {len(theirs)}"] if len(ours) != len(theirs) else []
        )
        for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
            found += differences(a, b, f"{path}[{i}]")
        return found
    return [] if ours == theirs else [f"{path}: ours {ours!r}, vLLM's {theirs!r}"]


def compare_whole(ours: Json, theirs: Json) -> list[str]:
    return differences(normalized(ours), normalized(theirs))


def folded(events: list[Json]) -> Json:
    """What a client makes of a stream: per choice, its text, token ids and logprobs joined,
    its tool-call deltas folded (``deltas_of``), its finish; the usage event; and the set of
    key shapes each kind of event had."""
    choices: dict[int, Json] = {}
    shapes: set[tuple[str, tuple[str, ...]]] = set()
    usage = prompt = None
    for event in events:
        kind = _kind(event)
        shapes.add((f"{kind} event", tuple(sorted(event))))
        usage = event.get("usage", usage)
        prompt = event.get("prompt_token_ids") or prompt
        for choice in event["choices"]:
            shapes.add((f"{kind} choice", tuple(sorted(choice))))
            into = choices.setdefault(choice["index"], {"events": []})
            into["events"].append({**event, "choices": [choice]})
            for key in ("finish_reason", "stop_reason", "prompt_token_ids"):
                if choice.get(key) is not None:
                    into[key] = choice[key]
            if choice.get("token_ids") is not None:
                into.setdefault("token_ids", []).extend(choice["token_ids"])
            if "text" in choice:
                into["text"] = into.get("text", "") + choice["text"]
            logprobs = choice.get("logprobs")
            if logprobs is not None:
                joined = into.setdefault("logprobs", {})
                for key, items in logprobs.items():
                    joined.setdefault(key, []).extend(items or [])
    out: Json = {"usage": usage, "prompt_token_ids": prompt, "shapes": frozenset(shapes)}
    for index, choice in choices.items():
        events_of = choice.pop("events")
        if any("delta" in c for e in events_of for c in e["choices"]):
            choice["deltas"] = deltas_of(events_of)
        out[f"choice {index}"] = choice
    return out


def _kind(event: Json) -> str:
    """Where an event stands in its stream: the ``final`` one (a finish reason), a chat
    stream's ``opening`` one (the assistant's role, before any token), or a ``middle`` one."""
    choices = event.get("choices", ())
    if any(c.get("finish_reason") for c in choices):
        return "final"
    if any("role" in (c.get("delta") or {}) for c in choices):
        return "opening"
    return "middle"


def compare_streams(ours: list[Json], theirs: list[Json]) -> list[str]:
    mine, other = folded(ours), folded(theirs)
    # Whether a stream has events between its opening and its final one depends on timing (a
    # short answer's tokens and its end can all arrive merged in one event): their shapes, and
    # their choices', are compared only when both streams have some.
    if not _has_middle(mine) or not _has_middle(other):
        for side in (mine, other):
            side["shapes"] = frozenset(s for s in side["shapes"] if not s[0].startswith("middle"))
    return differences(normalized(mine), normalized(other))


def _has_middle(folded_stream: Json) -> bool:
    return any(kind == "middle event" for kind, _ in folded_stream["shapes"])


def deltas_of(events: list[Json]) -> list[Any]:
    """The sequence of (delta, finish_reason) a client folds, ids blanked. Consecutive pieces
    of plain content are joined, and a finish reason that comes alone (an empty delta) goes
    with the piece before it: how many tokens one event carries, and whether the last ones
    come with the finish, depends on timing (vLLM's output handler merges what its consumer
    has not taken yet; on a loaded machine a stream's last tokens and its end arrive apart),
    what they say does not. A call's header and the argument pieces after it are folded into
    one call, as a client folds them (the edge sends a forced call whole, vLLM's server in
    pieces)."""
    joined: list[Any] = []
    for event in events:
        for choice in event["choices"]:
            for delta, finish in _pieces(normalized(choice["delta"]), choice["finish_reason"]):
                _fold(joined, delta, finish)
    return [(delta, finish) for delta, finish, _ in joined]


def _pieces(delta: Json, finish: str | None) -> list[tuple[Json, Any]]:
    """A delta as the deltas it may be made of: vLLM's server, given several tokens at once by
    its output handler (a slow consumer), sends a call's header and its arguments as one delta
    listing both; the finish reason goes with the last."""
    calls = delta.get("tool_calls") or []
    if len(calls) < 2:
        return [(delta, finish)]
    rest = {"content": None} if "content" in delta else {}
    pieces = [{**delta, "tool_calls": calls[:1]}] + [{**rest, "tool_calls": [c]} for c in calls[1:]]
    return [(piece, finish if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]


def _fold(joined: list[Any], delta: Json, finish: str | None) -> None:
    """Adds one delta to ``joined`` ([delta, finish, what it appends to]), joined with the one
    before where it only appends to the same text."""
    if not delta and finish is not None and joined and joined[-1][1] is None:
        joined[-1][1], joined[-1][2] = finish, None
        return
    key = _appending(delta)
    if key is not None and joined and joined[-1][2] == key:
        _append(joined[-1][0], delta)
        joined[-1][1] = finish
    else:
        joined.append([delta, finish, key or _opened_call(delta)])
    if finish is not None:
        joined[-1][2] = None


def _appending(delta: Json) -> str | None:
    """What a delta only appends to (content, reasoning, or one call's arguments), else None."""
    for text in ("content", "reasoning"):
        if set(delta) == {text} and isinstance(delta[text], str):
            return text
    calls = delta.get("tool_calls") or []
    if (
        set(delta) <= {"content", "tool_calls"}
        and delta.get("content") is None
        and len(calls) == 1
        and set(calls[0]) == {"index", "function"}
        and set(calls[0]["function"]) == {"arguments"}
    ):
        return f"arguments {calls[0]['index']}"
    return None


def _opened_call(delta: Json) -> str | None:
    """The arguments a delta that opens one call (its name) is followed by: what a client folds
    into that call. vLLM's server streams a call's header and then its arguments in pieces;
    the edge sends a forced call whole, in one delta, once it is complete."""
    calls = delta.get("tool_calls") or []
    if len(calls) == 1 and (calls[0].get("function") or {}).get("name"):
        return f"arguments {calls[0]['index']}"
    return None


def _append(into: Json, delta: Json) -> None:
    if "tool_calls" in delta:
        function = into["tool_calls"][0]["function"]
        function["arguments"] = (
            function.get("arguments", "") + delta["tool_calls"][0]["function"]["arguments"]
        )
    else:
        (key,) = delta
        into[key] += delta[key]
