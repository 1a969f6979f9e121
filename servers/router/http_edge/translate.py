"""OpenAI HTTP JSON <-> the DataPlane contract: pure functions, no network.

Requests are read the way vLLM's OpenAI server reads them (the OpenAI fields plus vLLM's
token-in / token-out extensions) into a ``GenerationCall``: prompts as token ids (or text and
chat messages that the engine's tokenizer turns into ids first) and ``SamplingParams``.
Responses are built from the contract's samples and stream messages in OpenAI's shapes, with
vLLM's ``token_ids`` / ``prompt_token_ids`` when ``return_token_ids`` is set. Anything that does
not fit raises ``InvalidArgument`` naming the field, which the edge answers with a 400 in
OpenAI's error shape.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from skyrl_grpc import finish_reasons
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.v1 import data_plane_pb2
from skyrl_grpc.v1 import generation_pb2 as gen

Json = dict[str, Any]

# The gRPC status of a failed call -> the HTTP status and OpenAI error type that say the same.
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}

# OpenAI fields this edge cannot honour: refused when set to anything but their default,
# rather than silently ignored.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (False, None),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "logit_bias": (None, {}),
}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's and vLLM's completions endpoint


def error_body(status: grpc.StatusCode, message: str) -> tuple[int, Json]:
    """The HTTP status and OpenAI error body for a failed call."""
    http, kind = HTTP_STATUS.get(status, (500, "internal_error"))
    return http, {"error": {"message": message, "type": kind, "param": None, "code": http}}


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

    def tokenize_request(self, prompt: str | None = None) -> data_plane_pb2.TokenizeRequest:
        """What turns a text prompt (or the conversation, for chat) into token ids."""
        if self.chat:
            return data_plane_pb2.TokenizeRequest(
                conversation=data_plane_pb2.ChatConversation(
                    messages=self.messages, add_generation_prompt=self.add_generation_prompt
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


def _token_ids(value: Any, key: str) -> list[int] | None:
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        if any(t < 0 for t in value):
            raise InvalidArgument(f"'{key}': token ids must be >= 0")
        return list(value)
    return None


def _sampling(body: Json, chat: bool) -> gen.SamplingParams:
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
        ids = _token_ids(stop_ids, "stop_token_ids")
        if ids is None:
            raise InvalidArgument("'stop_token_ids' must be a list of token ids")
        p.stop_token_ids.extend(ids)
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
    return data_plane_pb2.ChatMessage(role=raw["role"], content=text)


def read_generation(body: Json, chat: bool) -> GenerationCall:
    """An OpenAI (chat) completion request, checked and translated."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    for key, defaults in _UNSUPPORTED.items():
        if key in body and body[key] not in defaults:
            raise InvalidArgument(f"'{key}' is not supported by this server")
    best_of = body.get("best_of")
    n = _get(body, "n", int, 1)
    if best_of is not None and best_of != n:
        raise InvalidArgument("'best_of' other than 'n' is not supported by this server")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise InvalidArgument("'stream_options' must be an object")
    call = GenerationCall(
        chat=chat,
        model=str(body.get("model") or ""),
        sampling=_sampling(body, chat),
        n=n,
        stream=bool(_get(body, "stream", bool, False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        return_token_ids=bool(_get(body, "return_token_ids", bool, False)),
        include_stop_str_in_output=bool(_get(body, "include_stop_str_in_output", bool, False)),
        add_special_tokens=bool(_get(body, "add_special_tokens", bool, not chat)),
        add_generation_prompt=bool(_get(body, "add_generation_prompt", bool, True)),
        id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
    )
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("'messages' must be a non-empty list")
        call.messages = [_message(m, i) for i, m in enumerate(messages)]
        return call
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        call.prompts = [prompt]
    elif (ids := _token_ids(prompt, "prompt")) is not None:
        call.prompts = [ids]
    elif isinstance(prompt, list) and prompt:
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                call.prompts.append(item)
            elif (ids := _token_ids(item, f"prompt[{i}]")) is not None:
                call.prompts.append(ids)
            else:
                raise InvalidArgument(f"'prompt[{i}]' must be text or a list of token ids")
    else:
        raise InvalidArgument(
            "'prompt' must be text, a list of token ids, or a list of either (non-empty)"
        )
    return call


# -- responses -----------------------------------------------------------------------------


@dataclass
class SampleOut:
    """One finished (or, streamed, partial) sample as the edge reports it."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: gen.Logprobs | None = None


def finish_of(
    reason: int, stop: gen.StopMatch, text: str, call: GenerationCall
) -> tuple[str | None, int | str | None, str]:
    """OpenAI's finish_reason, vLLM's stop_reason, and the text with the stop string put back
    when the caller asked for it."""
    finish = finish_reasons.name_of(reason)
    stop_reason: int | str | None = None
    which = stop.WhichOneof("match")
    if which == "text":
        stop_reason = stop.text
        if call.include_stop_str_in_output:
            text += stop.text
    elif which == "token_id" and stop.token_id in call.sampling.stop_token_ids:
        stop_reason = stop.token_id  # None for end-of-sequence, as vLLM reports it
    return finish, stop_reason, text


def _completion_logprobs(
    logprobs: gen.Logprobs, token_ids: Sequence[int], texts: Mapping[int, str]
) -> Json:
    tokens = [texts.get(t, "") for t in token_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top: list[dict[str, float]] | None = None
    if logprobs.top_logprobs:
        top = []
        for position, alternatives in enumerate(logprobs.top_logprobs):
            entry = {
                texts.get(t, ""): lp
                for t, lp in zip(alternatives.token_ids, alternatives.logprobs, strict=False)
            }
            entry.setdefault(tokens[position], logprobs.token_logprobs[position])
            top.append(entry)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs.token_logprobs),
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_logprobs(
    logprobs: gen.Logprobs, token_ids: Sequence[int], texts: Mapping[int, str]
) -> Json:
    content = []
    for position, (token_id, lp) in enumerate(
        zip(token_ids, logprobs.token_logprobs, strict=False)
    ):
        token = texts.get(token_id, "")
        alternatives = (
            logprobs.top_logprobs[position] if position < len(logprobs.top_logprobs) else None
        )
        content.append(
            {
                "token": token,
                "logprob": lp,
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {
                        "token": texts.get(t, ""),
                        "logprob": a,
                        "bytes": list(texts.get(t, "").encode()),
                    }
                    for t, a in zip(alternatives.token_ids, alternatives.logprobs, strict=False)
                ]
                if alternatives is not None
                else [],
            }
        )
    return {"content": content}


def logprob_token_ids(logprobs: gen.Logprobs | None, token_ids: Iterable[int]) -> set[int]:
    """Every token id whose text a logprobs answer needs."""
    if logprobs is None:
        return set()
    needed = set(token_ids)
    for alternatives in logprobs.top_logprobs:
        needed.update(alternatives.token_ids)
    return needed


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> Json:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": None,
    }


def usage_of(usages: Iterable[gen.Usage]) -> Json:
    """OpenAI usage of a response made of several requests (one per prompt)."""
    listed = list(usages)
    return usage(
        sum(u.prompt_tokens for u in listed),
        sum(u.completion_tokens for u in listed),
        sum(u.cached_prompt_tokens for u in listed),
    )


def choice(
    call: GenerationCall, sample: SampleOut, texts: Mapping[int, str], prompt: Sequence[int]
) -> Json:
    """One entry of a whole response's ``choices``."""
    if call.chat:
        out: Json = {
            "index": sample.index,
            "message": {
                "role": "assistant",
                "content": sample.text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
            },
            "logprobs": _chat_logprobs(sample.logprobs, sample.token_ids, texts)
            if sample.logprobs is not None
            else None,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
        }
    else:
        out = {
            "index": sample.index,
            "text": sample.text,
            "logprobs": _completion_logprobs(sample.logprobs, sample.token_ids, texts)
            if sample.logprobs is not None
            else None,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
        }
        if call.return_token_ids:
            out["prompt_token_ids"] = list(prompt)
    if call.return_token_ids:
        out["token_ids"] = sample.token_ids
    return out


def response(
    call: GenerationCall,
    choices: list[Json],
    usage_: Json,
    prompt: Sequence[int] | None = None,
) -> Json:
    """A whole (non-streamed) response."""
    out: Json = {
        "id": call.id,
        "object": "chat.completion" if call.chat else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": sorted(choices, key=lambda c: int(c["index"])),
        "usage": usage_,
        "system_fingerprint": None,
        "service_tier": None,
    }
    if call.chat and call.return_token_ids and prompt is not None:
        out["prompt_token_ids"] = list(prompt)
    return out


def chunk(call: GenerationCall, choices: list[Json], usage_: Json | None = None) -> Json:
    """One server-sent event of a streamed response."""
    out: Json = {
        "id": call.id,
        "object": "chat.completion.chunk" if call.chat else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if usage_ is not None:
        out["usage"] = usage_
    return out


def chunk_choice(
    call: GenerationCall,
    index: int,
    text: str,
    token_ids: Sequence[int],
    finish_reason: str | None,
    stop_reason: int | str | None,
    logprobs: gen.Logprobs | None,
    texts: Mapping[int, str],
    first: bool = False,
    prompt: Sequence[int] | None = None,
) -> Json:
    """One choice of a streamed event: a delta of text (and token ids)."""
    if call.chat:
        delta: Json = {"content": text}
        if first:
            delta["role"] = "assistant"
        out: Json = {
            "index": index,
            "delta": delta,
            "logprobs": _chat_logprobs(logprobs, token_ids, texts)
            if logprobs is not None
            else None,
            "finish_reason": finish_reason,
        }
    else:
        out = {
            "index": index,
            "text": text,
            "logprobs": _completion_logprobs(logprobs, token_ids, texts)
            if logprobs is not None
            else None,
            "finish_reason": finish_reason,
        }
    if finish_reason is not None:
        out["stop_reason"] = stop_reason
    if call.return_token_ids:
        out["token_ids"] = list(token_ids)
        if first and prompt is not None:
            out["prompt_token_ids"] = list(prompt)
    return out


def models(model_info: data_plane_pb2.GetModelInfoResponse, created: int) -> Json:
    """``GET /v1/models``: the base model, then its loaded LoRA adapters (``model`` selects
    one), as vLLM lists them."""
    base = model_info.served_model_name
    entries = [
        {
            "id": base,
            "object": "model",
            "created": created,
            "owned_by": "skyrl-grpc",
            "root": base,
            "parent": None,
            "max_model_len": model_info.max_context_length,
        }
    ]
    for adapter in model_info.lora_adapters:
        entries.append(
            {
                "id": adapter.name,
                "object": "model",
                "created": created,
                "owned_by": "skyrl-grpc",
                "root": adapter.name,
                "parent": base,
                "lora_version": adapter.version,
            }
        )
    return {"object": "list", "data": entries}


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
    ids = _token_ids(tokens, "tokens") if tokens != [] else []
    if ids is None:
        raise InvalidArgument("'tokens' must be a list of token ids")
    return data_plane_pb2.DetokenizeRequest(token_ids=ids)
