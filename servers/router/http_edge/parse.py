"""OpenAI HTTP requests -> the DataPlane contract: pure functions, no network.

Requests are read the way vLLM's OpenAI server reads them (the OpenAI fields plus vLLM's
token-in / token-out extensions) into a ``GenerationCall``: prompts as token ids (or text and
chat messages that the engine's tokenizer turns into ids first) and ``SamplingParams``.
Anything that does not fit raises ``InvalidArgument`` naming the field, which the edge answers
with a 400 in OpenAI's error shape.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from servers.router.http_edge.tool_calls import read_message_tools, read_tool_use
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.v1 import chat_tools_pb2, data_plane_pb2
from skyrl_grpc.v1 import generation_pb2 as gen

Json = dict[str, Any]

# OpenAI fields this edge cannot honour: refused when set to anything but their default,
# rather than silently ignored.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (False, None),
    "suffix": (None, ""),
    "functions": (None, []),
}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's and vLLM's completions endpoint


@dataclass
class GenerationCall:
    """One OpenAI generation request, read."""

    chat: bool
    model: str
    sampling: gen.SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    # Completions: one entry per prompt, token ids or text to tokenize first.
    prompts: list[list[int] | str] = field(default_factory=list)
    # Chat: the conversation to render with the model's chat template.
    messages: list[data_plane_pb2.ChatMessage] = field(default_factory=list)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    id: str = ""
    created: int = 0
    # The LoRA adapter ``model`` named (empty: the base model).
    lora: str = ""
    # Chat: the tools offered and the tool choice.
    tool_use: chat_tools_pb2.ToolUse = field(default_factory=chat_tools_pb2.ToolUse)

    def tokenize_request(self, prompt: str | None = None) -> data_plane_pb2.TokenizeRequest:
        """What turns a text prompt (or the conversation, for chat) into token ids."""
        if self.chat:
            return data_plane_pb2.TokenizeRequest(
                conversation=data_plane_pb2.ChatConversation(
                    messages=self.messages,
                    add_generation_prompt=self.add_generation_prompt,
                    tools=self.tool_use.tools,
                )
            )
        return data_plane_pb2.TokenizeRequest(
            text=prompt or "", add_special_tokens=self.add_special_tokens
        )


def _get(body: Json, key: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise InvalidArgument(f"'{key}' must be a number, not a boolean")
    if not isinstance(value, kinds):
        names = (
            kinds.__name__ if isinstance(kinds, type) else " or ".join(k.__name__ for k in kinds)
        )
        raise InvalidArgument(f"'{key}' must be {names}, got {type(value).__name__}")
    return value


def token_ids_of(value: Any, key: str) -> list[int] | None:
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        if any(t < 0 for t in value):
            raise InvalidArgument(f"'{key}': token ids must be >= 0")
        return list(value)
    return None


def read_sampling(body: Json, chat: bool) -> gen.SamplingParams:
    p = gen.SamplingParams()
    for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"):  # fmt: skip
        value = _get(body, key, (int, float))
        if value is not None:
            setattr(p, key, float(value))
    for key in ("top_k", "seed", "min_tokens"):
        value = _get(body, key, int)
        if value is not None:
            setattr(p, key, value)
    max_tokens = _get(body, "max_completion_tokens", int, _get(body, "max_tokens", int))
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None:
        p.max_tokens = max_tokens
    p.ignore_eos = bool(_get(body, "ignore_eos", bool, False))
    skip = _get(body, "skip_special_tokens", bool)
    if skip is not None:
        p.skip_special_tokens = skip
    stop = body.get("stop")
    if isinstance(stop, str):
        p.stop_strings.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        p.stop_strings.extend(stop)
    elif stop is not None:
        raise InvalidArgument("'stop' must be a string or a list of strings")
    stop_ids = body.get("stop_token_ids")
    if stop_ids:
        ids = token_ids_of(stop_ids, "stop_token_ids")
        if ids is None:
            raise InvalidArgument("'stop_token_ids' must be a list of token ids")
        p.stop_token_ids.extend(ids)
    bias = _get(body, "logit_bias", dict)
    if bias:
        try:
            p.logit_bias.update({int(k): float(v) for k, v in bias.items()})
        except (TypeError, ValueError):
            raise InvalidArgument(
                "'logit_bias' maps token ids (as strings) to numbers in -100..100"
            ) from None
    allowed = body.get("allowed_token_ids")
    if allowed:
        ids = token_ids_of(allowed, "allowed_token_ids")
        if ids is None:
            raise InvalidArgument("'allowed_token_ids' must be a list of token ids")
        p.allowed_token_ids.extend(ids)
    constraint = _structured_output(body)
    if constraint is not None:
        p.structured_output.CopyFrom(constraint)
    if chat:
        if _get(body, "logprobs", bool, False):
            p.logprobs = _get(body, "top_logprobs", int, 0)
        elif body.get("top_logprobs"):
            raise InvalidArgument("'top_logprobs' needs 'logprobs': true")
    else:
        logprobs = _get(body, "logprobs", int)
        if logprobs is not None:
            p.logprobs = logprobs
    return p


def _structured_output(body: Json) -> gen.StructuredOutput | None:
    """OpenAI's ``response_format`` (json_object, json_schema), vLLM's ``structured_outputs``
    (json, json_object, regex, choice, grammar, structural_tag) and its older ``guided_*``
    fields."""
    import json

    found: list[gen.StructuredOutput] = []
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise InvalidArgument("'response_format' must be an object")
        kind = response_format.get("type")
        if kind == "json_object":
            found.append(gen.StructuredOutput(json_object=True))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidArgument("'response_format.json_schema.schema' must be an object")
            found.append(gen.StructuredOutput(json_schema=json.dumps(schema)))
        elif kind not in (None, "text"):
            raise InvalidArgument(
                f"'response_format.type' {kind!r}: use text, json_object or json_schema"
            )
    fields = dict(body.get("structured_outputs") or {})
    for old, new in (("guided_json", "json"), ("guided_regex", "regex"),
                     ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
        if body.get(old) is not None:
            fields[new] = body[old]
    for key, value in fields.items():
        if value is None or value is False:
            continue
        if key == "json":
            text = value if isinstance(value, str) else json.dumps(value)
            found.append(gen.StructuredOutput(json_schema=text))
        elif key == "json_object":
            found.append(gen.StructuredOutput(json_object=True))
        elif key == "regex" and isinstance(value, str):
            found.append(gen.StructuredOutput(regex=value))
        elif key == "grammar" and isinstance(value, str):
            found.append(gen.StructuredOutput(grammar=value))
        elif key == "structural_tag" and isinstance(value, str | dict):
            text = value if isinstance(value, str) else json.dumps(value)
            found.append(gen.StructuredOutput(structural_tag=text))
        elif key == "choice" and isinstance(value, list):
            choices = gen.ChoiceList(choices=[str(c) for c in value])
            found.append(gen.StructuredOutput(choice=choices))
        else:
            raise InvalidArgument(f"'structured_outputs.{key}' is not supported here")
    if len(found) > 1:
        raise InvalidArgument("give one output constraint (response_format or structured_outputs)")
    return found[0] if found else None


def _message(raw: Any, index: int) -> data_plane_pb2.ChatMessage:
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise InvalidArgument(f"'messages[{index}]' must be an object with a 'role'")
    content = raw.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):  # content parts: only text ones can be served
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidArgument(f"'messages[{index}].content': only text parts are supported")
            parts.append(str(part.get("text", "")))
        text = "".join(parts)
    else:
        raise InvalidArgument(f"'messages[{index}].content' must be a string or a list of parts")
    message = data_plane_pb2.ChatMessage(role=raw["role"], content=text)
    read_message_tools(raw, index, message)
    return message


def read_generation(body: Json, chat: bool) -> GenerationCall:
    """An OpenAI (chat) completion request, checked and translated."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    for key, defaults in _UNSUPPORTED.items():
        if key in body and body[key] not in defaults:
            raise InvalidArgument(f"'{key}' is not supported by this server")
    best_of = body.get("best_of")
    n = _get(body, "n", int, 1)
    if n < 1:  # OpenAI's and vLLM's servers refuse it; the contract would read 0 as 1
        raise InvalidArgument(f"'n' = {n}: the number of samples must be >= 1")
    if best_of is not None and best_of != n:
        raise InvalidArgument("'best_of' other than 'n' is not supported by this server")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise InvalidArgument("'stream_options' must be an object")
    stream = bool(_get(body, "stream", bool, False))
    if body.get("stream_options") is not None and not stream:  # as vLLM's server refuses it
        raise InvalidArgument("'stream_options' can only be given with 'stream': true")
    call = GenerationCall(
        chat=chat,
        model=str(body.get("model") or ""),
        sampling=read_sampling(body, chat),
        n=n,
        stream=stream,
        include_usage=bool(stream_options.get("include_usage", False)),
        return_token_ids=bool(_get(body, "return_token_ids", bool, False)),
        include_stop_str_in_output=bool(_get(body, "include_stop_str_in_output", bool, False)),
        add_special_tokens=bool(_get(body, "add_special_tokens", bool, not chat)),
        add_generation_prompt=bool(_get(body, "add_generation_prompt", bool, True)),
        id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
    )
    # vLLM's: the prompt tokens before this index are left out of the routed experts.
    start = _get(body, "routed_experts_prompt_start", int, 0)
    if start < 0:
        raise InvalidArgument("'routed_experts_prompt_start' must be 0 or more")
    call.sampling.routed_experts_prompt_start = start
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("'messages' must be a non-empty list")
        call.messages = [_message(m, i) for i, m in enumerate(messages)]
        call.tool_use = read_tool_use(body)
        return call
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        call.prompts = [prompt]
    elif (ids := token_ids_of(prompt, "prompt")) is not None:
        call.prompts = [ids]
    elif isinstance(prompt, list) and prompt:
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                call.prompts.append(item)
            elif (ids := token_ids_of(item, f"prompt[{i}]")) is not None:
                call.prompts.append(ids)
            else:
                raise InvalidArgument(f"'prompt[{i}]' must be text or a list of token ids")
    else:
        raise InvalidArgument(
            "'prompt' must be text, a list of token ids, or a list of either (non-empty)"
        )
    return call


def read_tokenize(body: Json) -> data_plane_pb2.TokenizeRequest:
    """vLLM's ``POST /tokenize``: ``prompt`` text, or chat ``messages``."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("'messages' must be a non-empty list")
        return data_plane_pb2.TokenizeRequest(
            conversation=data_plane_pb2.ChatConversation(
                messages=[_message(m, i) for i, m in enumerate(messages)],
                add_generation_prompt=bool(_get(body, "add_generation_prompt", bool, True)),
                tools=read_tool_use(body).tools,
            )
        )
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidArgument("'prompt' must be text (or send 'messages')")
    return data_plane_pb2.TokenizeRequest(
        text=prompt, add_special_tokens=bool(_get(body, "add_special_tokens", bool, True))
    )


def read_detokenize(body: Json) -> data_plane_pb2.DetokenizeRequest:
    """vLLM's ``POST /detokenize``: ``tokens``."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    tokens = body.get("tokens")
    ids = token_ids_of(tokens, "tokens") if tokens != [] else []
    if ids is None:
        raise InvalidArgument("'tokens' must be a list of token ids")
    return data_plane_pb2.DetokenizeRequest(token_ids=ids)
