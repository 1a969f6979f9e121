"""The DataPlane contract -> OpenAI HTTP responses: pure functions, no network.

Responses are built from the contract's samples and stream messages in OpenAI's shapes, with
vLLM's ``token_ids`` / ``prompt_token_ids`` when ``return_token_ids`` is set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from servers.router.http_edge import tool_calls
from servers.router.http_edge.parse import GenerationCall
from skyrl_grpc import finish_reasons, routed_experts
from skyrl_grpc.v1 import chat_tools_pb2, data_plane_pb2
from skyrl_grpc.v1 import generation_pb2 as gen

Json = dict[str, Any]


@dataclass
class SampleOut:
    """One finished (or, streamed, partial) sample as the edge reports it."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: gen.Logprobs | None = None
    # Chat: the engine's parse of the whole output (content, reasoning, tool calls).
    message: chat_tools_pb2.ChatMessageOut | None = None
    # The experts each token was routed to, as vLLM's server writes them (base64 ``.npy``).
    routed_experts: str | None = None


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


# Per output position: the text of each token id the answer names there (``token_texts``).
PositionTexts = Sequence[Mapping[int, str]]


def _completion_logprobs(
    logprobs: gen.Logprobs, token_ids: Sequence[int], texts: PositionTexts, text_offset: int = 0
) -> Json:
    """OpenAI's completion logprobs; ``text_offset``: where these tokens' text starts in the
    sample's whole text (a streamed event's: the length of what was streamed before)."""
    tokens = [texts[p].get(t, "") for p, t in enumerate(token_ids)]
    offsets, at = [], text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top: list[dict[str, float]] | None = None
    if logprobs.top_logprobs:
        top = []
        for position, alternatives in enumerate(logprobs.top_logprobs):
            entry = {
                texts[position].get(t, ""): lp
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


def _chat_logprobs(logprobs: gen.Logprobs, token_ids: Sequence[int], texts: PositionTexts) -> Json:
    content = []
    for position, (token_id, lp) in enumerate(
        zip(token_ids, logprobs.token_logprobs, strict=False)
    ):
        here = texts[position]
        token = here.get(token_id, "")
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
                        "token": here.get(t, ""),
                        "logprob": a,
                        "bytes": list(here.get(t, "").encode()),
                    }
                    for t, a in zip(alternatives.token_ids, alternatives.logprobs, strict=False)
                ]
                if alternatives is not None
                else [],
            }
        )
    return {"content": content}


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
    call: GenerationCall, sample: SampleOut, texts: PositionTexts, prompt: Sequence[int]
) -> Json:
    """One entry of a whole response's ``choices``, with every key vLLM's server writes (those
    of features this edge does not serve as null, as vLLM writes them when unused)."""
    token_ids = sample.token_ids if call.return_token_ids else None
    if call.chat:
        message: Json = {
            "role": "assistant",
            "content": sample.text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
            **(tool_calls.message_fields(sample.message) if sample.message else {}),
        }
        if not message.get("tool_calls"):
            message.pop("tool_calls", None)  # vLLM's server leaves an empty list out
        return {
            "index": sample.index,
            "message": message,
            "logprobs": _chat_logprobs(sample.logprobs, sample.token_ids, texts)
            if sample.logprobs is not None
            else None,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
            "token_ids": token_ids,
            "routed_experts": sample.routed_experts,
        }
    return {
        "index": sample.index,
        "text": sample.text,
        "logprobs": _completion_logprobs(sample.logprobs, sample.token_ids, texts)
        if sample.logprobs is not None
        else None,
        "finish_reason": sample.finish_reason,
        "stop_reason": sample.stop_reason,
        "token_ids": token_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": list(prompt) if call.return_token_ids else None,
        "routed_experts": sample.routed_experts,
    }


def response(
    call: GenerationCall,
    choices: list[Json],
    usage_: Json,
    prompt: Sequence[int] | None = None,
) -> Json:
    """A whole (non-streamed) response, with every key vLLM's server writes."""
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
    if call.chat:
        asked = call.return_token_ids and prompt is not None
        out["prompt_logprobs"] = None
        out["prompt_token_ids"] = list(prompt) if asked and prompt is not None else None
        out["prompt_text"] = None
    out["kv_transfer_params"] = None
    out["ec_transfer_params"] = None
    out["metrics"] = None
    return out


def chunk(call: GenerationCall, choices: list[Json], usage_: Json | None = None) -> Json:
    """One server-sent event of a streamed response, with the keys vLLM's server writes: a
    fingerprint on the terminal events only (a sample's finish, or the usage event that ends
    the stream when the caller asked for usage)."""
    out: Json = {
        "id": call.id,
        "object": "chat.completion.chunk" if call.chat else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": choices,
    }
    if usage_ is not None:
        out["usage"] = usage_
        out["system_fingerprint"] = None
    elif not call.include_usage and any(c["finish_reason"] is not None for c in choices):
        out["system_fingerprint"] = None
    return out


def chunk_choice(
    call: GenerationCall,
    index: int,
    text: str,
    token_ids: Sequence[int],
    finish_reason: str | None,
    stop_reason: int | str | None,
    logprobs: gen.Logprobs | None,
    texts: PositionTexts,
    first: bool = False,
    prompt: Sequence[int] | None = None,
    delta: Json | None = None,
    text_offset: int = 0,
) -> Json:
    """One choice of a streamed event: a delta of text (and token ids); for chat, ``delta``
    is what the engine parsed (content, reasoning, tool-call pieces). ``text_offset``: the
    length of the sample's text streamed before (completions' logprobs count from there).
    The keys are vLLM's server's (token ids null unless asked for)."""
    ids = list(token_ids) if call.return_token_ids else None
    if call.chat:
        out: Json = {
            "index": index,
            "delta": {"content": text} if delta is None else delta,
            "logprobs": _chat_logprobs(logprobs, token_ids, texts)
            if logprobs is not None
            else None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            out["stop_reason"] = stop_reason
        out["token_ids"] = ids
        if call.return_token_ids and first and prompt is not None:
            out["prompt_token_ids"] = list(prompt)
        return out
    return {
        "index": index,
        "text": text,
        "logprobs": _completion_logprobs(logprobs, token_ids, texts, text_offset)
        if logprobs is not None
        else None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "prompt_token_ids": list(prompt) if call.return_token_ids and first and prompt else None,
        "token_ids": ids,
    }


def role_chunk(call: GenerationCall, index: int, prompt: Sequence[int]) -> Json:
    """A chat stream's first event for a sample: the role, no text yet (as vLLM's server
    opens each choice), with the prompt's token ids when asked for."""
    choice = {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    out = chunk(call, [choice])
    out["prompt_token_ids"] = list(prompt) if call.return_token_ids else None
    out["prompt_text"] = None
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


def sample_out(
    sample: gen.Sample,
    call: GenerationCall,
    index_offset: int = 0,
    message: chat_tools_pb2.ChatMessageOut | None = None,
) -> SampleOut:
    """A whole sample (folded by ``skyrl_grpc.sample_assembly``) as the edge reports it;
    ``message``: a chat sample's parsed assistant message."""
    finish, stop_reason, text = finish_of(sample.finish_reason, sample.stop, sample.text, call)
    if message is not None:
        finish = tool_calls.whole_finish_reason(call.tool_use, message, finish)
    return SampleOut(
        index=index_offset + sample.index,
        token_ids=list(sample.token_ids),
        text=text,
        finish_reason=finish,
        stop_reason=stop_reason,
        logprobs=sample.logprobs if sample.HasField("logprobs") else None,
        message=message,
        routed_experts=(
            routed_experts.npy_base64(sample.routed_experts)
            if sample.HasField("routed_experts")
            else None
        ),
    )
