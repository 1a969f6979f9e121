"""vLLM's ``Inference`` service (its Rust front end's gRPC contract, package ``vllm``) to and from
this stack's DataPlane messages, for ``service.vllm_api``: a vLLM GenerateRequest becomes the
DataPlane's GenerateStreamRequest, and each of its stream messages a vLLM SequenceOutput, so both
protocols run the same checks and the same code. Each field vLLM's contract carries and this
server cannot honour is refused by name (UNIMPLEMENTED, saying what to send instead), never
dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from skyrl_grpc.errors import InvalidArgument, Unimplemented
from skyrl_grpc.v1 import data_plane_pb2 as dp
from skyrl_grpc.v1 import generation_pb2 as gen
from skyrl_grpc.vllm_api import inference_pb2 as vi

# The service's full name ("vllm.Inference").
INFERENCE: str = vi.DESCRIPTOR.services_by_name["Inference"].full_name
_FINISH_REASONS = {
    gen.FINISH_REASON_STOP: vi.FinishInfo.STOP,
    gen.FINISH_REASON_LENGTH: vi.FinishInfo.LENGTH,
    gen.FINISH_REASON_ABORTED: vi.FinishInfo.ABORTED,
}


def unsupported(field: str, instead: str) -> Unimplemented:
    """A field of vLLM's contract this server has no mapping for, and what to send instead."""
    return Unimplemented(f"{field}: this server does not take it; {instead}")


# -- Inference ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponseShape:
    """What a vLLM caller asked to get back (ResponseOptions, with vLLM's defaults)."""

    prompt_token_ids: bool = False
    prompt_logprobs: bool = False
    output_text: bool = True
    output_token_ids: bool = False
    output_logprobs: bool = False

    @classmethod
    def of(cls, request: vi.GenerateRequest) -> ResponseShape:
        if not request.HasField("response"):
            return cls()
        r = request.response
        return cls(
            prompt_token_ids=r.prompt_token_ids,
            prompt_logprobs=r.prompt_logprobs,
            output_text=r.output_text if r.HasField("output_text") else True,
            output_token_ids=r.output_token_ids,
            output_logprobs=r.output_logprobs,
        )


def _int32(value: int, field: str) -> int:
    """vLLM's unsigned 32-bit count as this stack's signed one (whose limits are far below)."""
    if value >= 1 << 31:
        raise InvalidArgument(f"{field} = {value}: too large (at most {(1 << 31) - 1})")
    return value


def _candidates(selector: vi.CandidateTokens, field: str) -> int:
    """How many alternatives per position a CandidateTokens asks for (0: the token's only)."""
    kind = selector.WhichOneof("select")
    if kind == "top_n":
        return _int32(selector.top_n, f"{field}.top_n")
    if kind == "all" and selector.all:
        raise unsupported(f"{field}.all", "ask for top_n (up to the server's --max-logprobs)")
    if kind == "token_ids" and selector.token_ids.ids:
        raise unsupported(f"{field}.token_ids", "ask for top_n instead")
    return 0


def _refuseunsupported(request: vi.GenerateRequest) -> None:
    if request.media:
        raise InvalidArgument("media: this server serves text models; send text or token_ids")
    if request.priority:
        raise unsupported("priority", "it schedules first come, first served; send 0")
    if request.HasField("kv"):
        kv = request.kv
        if kv.bypass_prefix_cache or kv.cache_salt:
            raise unsupported(
                "kv.bypass_prefix_cache / kv.cache_salt",
                "its prefix cache is salted by weight version; reset it with "
                "ControlPlane.ResetPrefixCache",
            )
        if kv.HasField("kv_transfer_params") or kv.HasField("ec_transfer_params"):
            raise unsupported("kv.kv_transfer_params", "it runs no KV connector")
    if request.HasField("kv_hints") or request.HasField("engine_reasoning_gate"):
        raise unsupported("kv_hints / engine_reasoning_gate", "leave them unset")
    if request.decoding.bad_words_token_ids:
        raise unsupported("decoding.bad_words_token_ids", "use decoding.logit_bias")
    if request.stopping.include_stop_strings:
        raise unsupported(
            "stopping.include_stop_strings", "the stop string is reported in FinishInfo"
        )
    if request.stopping.HasField("thinking_token_budget"):
        raise unsupported("stopping.thinking_token_budget", "use stopping.max_new_tokens")


def _structured(decoding: vi.DecodingParameters) -> gen.StructuredOutput | None:
    kind = decoding.WhichOneof("structured_output")
    if kind is None or (kind == "json_object" and not decoding.json_object):
        return None
    if kind == "json":
        return gen.StructuredOutput(json_schema=decoding.json)
    if kind == "choice":
        return gen.StructuredOutput(choice=gen.ChoiceList(choices=list(decoding.choice.choices)))
    return gen.StructuredOutput(**{kind: getattr(decoding, kind)})


def sampling_params(request: vi.GenerateRequest) -> gen.SamplingParams:
    """vLLM's sampling fields as this stack's. As vLLM's gRPC front end: temperature unset is
    greedy, a zero penalty is no penalty, max_new_tokens 0 is the server's default."""
    _refuseunsupported(request)
    params = gen.SamplingParams(
        temperature=request.temperature if request.HasField("temperature") else 0.0
    )
    sampling = request.sampling
    if sampling.HasField("top_k"):
        params.top_k = _int32(sampling.top_k, "sampling.top_k")
    if sampling.HasField("top_p"):
        params.top_p = sampling.top_p
    if sampling.HasField("min_p"):
        params.min_p = sampling.min_p
    if sampling.HasField("seed"):
        params.seed = sampling.seed
    decoding = request.decoding
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(decoding, name):
            setattr(params, name, getattr(decoding, name))
    params.logit_bias.update(decoding.logit_bias)
    params.allowed_token_ids.extend(decoding.allowed_token_ids)
    structured = _structured(decoding)
    if structured is not None:
        params.structured_output.CopyFrom(structured)
    stopping = request.stopping
    if stopping.max_new_tokens:
        params.max_tokens = _int32(stopping.max_new_tokens, "stopping.max_new_tokens")
    if stopping.min_new_tokens:
        params.min_tokens = _int32(stopping.min_new_tokens, "stopping.min_new_tokens")
    params.stop_token_ids.extend(stopping.stop_token_ids)
    params.stop_strings.extend(stopping.stop_strings)
    params.ignore_eos = stopping.ignore_eos
    response = request.response
    if response.HasField("skip_special_tokens"):
        params.skip_special_tokens = response.skip_special_tokens
    if response.output_logprobs:
        params.logprobs = _candidates(response.output_candidates, "response.output_candidates")
    if response.prompt_logprobs:
        params.prompt_logprobs = _candidates(
            response.prompt_candidates, "response.prompt_candidates"
        )
    return params


def generate_stream_request(
    request: vi.GenerateRequest,
    prompt_token_ids: list[int],
    served_model_name: str,
    shape: ResponseShape,
) -> dp.GenerateStreamRequest:
    """The DataPlane's request for a vLLM GenerateRequest whose prompt is ``prompt_token_ids``
    (the text tokenized, when it came as text) and whose answer is shaped as ``shape``."""
    if request.model and request.model != served_model_name:
        raise InvalidArgument(
            f"model = {request.model!r}: this server serves {served_model_name!r} (or leave "
            "model empty); a LoRA adapter goes in lora_name"
        )
    if request.truncate_prompt_tokens:
        prompt_token_ids = prompt_token_ids[-request.truncate_prompt_tokens :]
    return dp.GenerateStreamRequest(
        request_id=request.request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sampling_params(request),
        n=request.sampling.num_sequences or 1,
        include_text=shape.output_text,
        lora=request.lora_name,
    )


def _candidate_infos(logprobs: gen.Logprobs) -> list[vi.CandidateTokenInfo]:
    return [
        vi.CandidateTokenInfo(
            tokens=[
                vi.CandidateTokenInfo.TokenInfo(id=token, logprob=value, rank=rank)
                for rank, (token, value) in enumerate(
                    zip(top.token_ids, top.logprobs, strict=True), start=1
                )
            ]
        )
        for top in logprobs.top_logprobs
    ]


def prompt_info(
    prompt_token_ids: list[int], first: dp.GenerateStreamResponse | None, shape: ResponseShape
) -> vi.PromptInfo:
    info = vi.PromptInfo(num_prompt_tokens=len(prompt_token_ids))
    if shape.prompt_token_ids:
        info.token_ids.extend(prompt_token_ids)
    if shape.prompt_logprobs and first is not None and first.HasField("prompt_logprobs"):
        info.logprobs.extend(first.prompt_logprobs.token_logprobs)
        info.candidate_tokens.extend(_candidate_infos(first.prompt_logprobs))
    return info


class SequenceOutputs:
    """Turns the DataPlane's stream messages of one request into vLLM's SequenceOutputs,
    counting each sample's tokens for its FinishInfo."""

    def __init__(self, shape: ResponseShape, stop_token_ids: Iterable[int], eos: list[int]):
        self._shape = shape
        self._stop_ids = set(stop_token_ids)
        self._eos = set(eos)
        self._counts: dict[int, int] = {}

    def convert(self, message: dp.GenerateStreamResponse) -> vi.SequenceOutput:
        shape = self._shape
        index = message.sample_index
        self._counts[index] = self._counts.get(index, 0) + len(message.token_ids)
        output = vi.SequenceOutput(index=index, num_tokens=len(message.token_ids))
        if shape.output_text:
            output.text = message.text
        if shape.output_token_ids:
            output.token_ids.extend(message.token_ids)
        if shape.output_logprobs and message.HasField("logprobs"):
            output.logprobs.extend(message.logprobs.token_logprobs)
            output.candidate_tokens.extend(_candidate_infos(message.logprobs))
        if message.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
            output.finish_info.CopyFrom(self._finish(message, self._counts[index]))
        return output

    def _finish(self, message: dp.GenerateStreamResponse, count: int) -> vi.FinishInfo:
        info = vi.FinishInfo(
            num_output_tokens=count,
            finish_reason=_FINISH_REASONS[message.finish_reason],
            num_cached_tokens=message.usage.cached_prompt_tokens,
        )
        match = message.stop.WhichOneof("match")
        if match == "text":
            info.stop_string = message.stop.text
        elif match == "token_id":
            token = message.stop.token_id
            if token in self._eos and token not in self._stop_ids:
                info.eos_token_id = token
            else:
                info.stop_token_id = token
        return info


def joined(outputs: list[vi.SequenceOutput]) -> vi.SequenceOutput:
    """One sample's SequenceOutputs as the single one a unary Generate returns."""
    whole = vi.SequenceOutput(index=outputs[0].index if outputs else 0)
    for part in outputs:
        whole.text += part.text
        whole.num_tokens += part.num_tokens
        whole.token_ids.extend(part.token_ids)
        whole.logprobs.extend(part.logprobs)
        whole.candidate_tokens.extend(part.candidate_tokens)
        if part.HasField("finish_info"):
            whole.finish_info.CopyFrom(part.finish_info)
    return whole
