"""vLLM's token-in / token-out endpoint (``POST /inference/v1/generate``) and its chat render
(``POST /v1/chat/completions/render``), in vLLM's request and response shapes: pure functions,
no network.

Clients written for vLLM's endpoints -- SkyRL's ``RemoteInferenceClient`` among them, which
posts ``{"token_ids", "sampling_params", "model"}`` and reads ``choices[0].token_ids``,
``logprobs.content[].logprob`` and ``finish_reason`` -- run against the edge unchanged. The
render answers with the request ``/inference/v1/generate`` takes, as vLLM's does. Every choice
carries vLLM's ``weight_versions``: which weights produced which tokens.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from google.protobuf.json_format import MessageToDict

from servers.router.http_edge.parse import GenerationCall, read_sampling, token_ids_of
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.v1 import generation_pb2 as gen

Json = dict[str, Any]

# vLLM's SamplingParams fields this edge honours (its names); anything else is refused by
# name rather than silently dropped.
SAMPLING_KEYS = frozenset(
    {
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids",
        "ignore_eos", "logprobs", "prompt_logprobs", "skip_special_tokens", "logit_bias",
        "allowed_token_ids", "structured_outputs", "include_stop_str_in_output", "detokenize",
        "spaces_between_special_tokens", "output_kind",
    }
)  # fmt: skip
# vLLM's RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY): how a stream reports; a whole
# answer is the same for each. SkyRL's ``sample`` sends FINAL_ONLY.
_OUTPUT_KINDS = (0, 1, 2)
# Top-level fields of vLLM's GenerateRequest that need nothing from this edge.
_IGNORED = frozenset({"stream_options", "priority", "output_mode", "return_token_ids"})


def read_generate(body: Json) -> GenerationCall:
    """A ``/inference/v1/generate`` request as a completion call on token ids."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    known = {"request_id", "token_ids", "sampling_params", "model", "stream", *_IGNORED}
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidArgument(f"not supported by this server: {', '.join(unknown)}")
    if body.get("output_mode", "tokens") != "tokens":
        raise InvalidArgument("'output_mode': only 'tokens' is served here")
    prompt = token_ids_of(body.get("token_ids"), "token_ids")
    if prompt is None:
        raise InvalidArgument("'token_ids' must be a non-empty list of token ids")
    sampling = body.get("sampling_params")
    sampling = {} if sampling is None else sampling
    if not isinstance(sampling, dict):
        raise InvalidArgument("'sampling_params' must be an object")
    unknown = sorted(set(sampling) - SAMPLING_KEYS)
    if unknown:
        raise InvalidArgument(
            f"sampling_params: {', '.join(unknown)} not supported (supported: "
            f"{', '.join(sorted(SAMPLING_KEYS))})"
        )
    if sampling.get("output_kind", 0) not in _OUTPUT_KINDS:
        raise InvalidArgument(
            "'sampling_params.output_kind' must be 0 (cumulative), 1 (delta) or 2 (final only)"
        )
    sampling = {k: v for k, v in sampling.items() if k != "output_kind"}
    params = read_sampling(sampling, chat=False)
    if sampling.get("prompt_logprobs") is not None:
        params.prompt_logprobs = int(sampling["prompt_logprobs"])
    n = sampling.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgument("'sampling_params.n' must be an integer >= 1")
    request_id = body.get("request_id")
    return GenerationCall(
        chat=False,
        model=str(body.get("model") or ""),
        sampling=params,
        n=n,
        stream=bool(body.get("stream") or False),
        return_token_ids=True,
        include_stop_str_in_output=bool(sampling.get("include_stop_str_in_output", False)),
        prompts=[prompt],
        id=str(request_id) if request_id else f"gen-{uuid.uuid4().hex}",
    )


def _logprobs(logprobs: gen.Logprobs, token_ids: list[int]) -> Json:
    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs.token_logprobs, strict=False)):
        top = logprobs.top_logprobs[i] if i < len(logprobs.top_logprobs) else None
        content.append(
            {
                "token_id": token_id,
                "logprob": logprob,
                "top_logprobs": [
                    {"token_id": t, "logprob": lp, "rank": rank}
                    for rank, (t, lp) in enumerate(
                        zip(top.token_ids, top.logprobs, strict=False), start=1
                    )
                ]
                if top is not None
                else [],
            }
        )
    return {"content": content}


def weight_versions(sample: gen.Sample) -> list[Json]:
    """vLLM's ``WeightVersionSpan``s: tokens ``[start, end)`` sampled by weights ``version``."""
    return [
        {"version": str(s.weight_version), "start": s.start, "end": s.start + s.length}
        for s in sample.weight_versions
    ]


def choice(
    sample: gen.Sample, finish: str | None, stop_reason: int | str | None, index: int
) -> Json:
    """One choice of a whole answer (vLLM's ``GenerateTokensChoice``)."""
    token_ids = list(sample.token_ids)
    return {
        "index": index,
        "finish_reason": finish,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
        "logprobs": _logprobs(sample.logprobs, token_ids) if sample.HasField("logprobs") else None,
        "weight_versions": weight_versions(sample),
    }


def response(
    call: GenerationCall, choices: list[Json], usage: Json, created: int, prompt: list[int]
) -> Json:
    """A whole answer (vLLM's ``GenerateTokensResponse``)."""
    return {
        "request_id": call.id,
        "output_mode": "tokens",
        "model": call.model,
        "created": created,
        "usage": usage,
        "prompt_token_ids": prompt,
        "choices": sorted(choices, key=lambda c: int(c["index"])),
    }


def stream_chunk(call: GenerationCall, choices: list[Json], usage: Json | None = None) -> Json:
    """One server-sent event of a streamed answer (vLLM's ``GenerateTokensStreamResponse``)."""
    out: Json = {"request_id": call.id, "output_mode": "tokens", "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def sampling_dict(params: gen.SamplingParams) -> Json:
    """The contract's sampling parameters under vLLM's names (what a render hands back)."""
    raw = MessageToDict(params, preserving_proto_field_name=True)
    out: Json = {}
    for key, value in raw.items():
        if key == "stop_strings":
            out["stop"] = value
        elif key == "structured_output":
            (kind, constraint), *_ = value.items()
            if kind == "json_schema":
                out["structured_outputs"] = {"json": json.loads(constraint)}
            elif kind == "choice":
                out["structured_outputs"] = {"choice": constraint.get("choices", [])}
            else:
                out["structured_outputs"] = {kind: constraint}
        else:
            out[key] = value
    return out


def render_response(call: GenerationCall, token_ids: list[int]) -> Json:
    """A chat request rendered: the ``/inference/v1/generate`` request that serves it."""
    return {
        "request_id": call.id,
        "token_ids": token_ids,
        "sampling_params": {"n": call.n, **sampling_dict(call.sampling)},
        "model": call.model,
        "stream": call.stream,
        "features": None,
    }
