"""Pure conversions between the contract's messages and vLLM's types.

No engine and no gRPC context here, and the request rules are ``validate``'s: every function
takes values that already passed them, so each conversion is unit tested directly. One check
is vLLM's own: ``build_sampling_params`` turns vLLM's refusal of a combination the contract's
ranges do not cover into INVALID_ARGUMENT. The control plane's messages are
``control_convert``'s. ``StreamConverter`` and ``ChunkCoalescer`` turn vLLM's output deltas into
the contract's stream messages; ``model_info_to_proto`` answers GetModelInfo.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from servers.engine.domain.descriptions import ModelDescription
from servers.engine.domain.lora_adapters import LoadedAdapter
from skyrl_grpc import finish_reasons, routed_experts
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.stream_chunks import merge_into
from skyrl_grpc.v1 import data_plane_pb2, generation_pb2, lora_pb2

if TYPE_CHECKING:
    from vllm import SamplingParams as VllmSamplingParams

# Optional sampling fields passed to vLLM under the same name when set.
_PASSED_WHEN_SET = (
    "temperature",
    "top_p",
    "min_p",
    "min_tokens",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
)


def build_sampling_params(
    params: generation_pb2.SamplingParams, *, n: int, max_tokens: int, detokenize: bool
) -> VllmSamplingParams:
    """vLLM's sampling parameters (streaming deltas) for validated contract parameters."""
    # Imported here: the server opens its port before vLLM (seconds of imports) is loaded.
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    kwargs: dict[str, Any] = {
        "n": n,
        "output_kind": RequestOutputKind.DELTA,
        "max_tokens": max_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        # Stop strings are matched on text, so they need detokenization even for token-out.
        "detokenize": detokenize or bool(params.stop_strings),
        # Logprobs as flat lists instead of a dict of Logprob objects per position: building
        # those dicts took half of the server's event loop under logprobs-heavy load, and
        # logprobs_to_proto reads the flat lists directly.
        "flat_logprobs": True,
    }
    if params.stop_strings:
        kwargs["stop"] = list(params.stop_strings)
    if params.HasField("top_k"):
        kwargs["top_k"] = 0 if params.top_k == -1 else params.top_k
    for name in _PASSED_WHEN_SET:
        if params.HasField(name):
            kwargs[name] = getattr(params, name)
    if params.logit_bias:
        kwargs["logit_bias"] = dict(params.logit_bias)
    if params.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(params.allowed_token_ids)
    if params.HasField("structured_output"):
        kwargs["structured_outputs"] = structured_outputs_params(params.structured_output)
    if params.return_routed_experts:
        kwargs["routed_experts_prompt_start"] = params.routed_experts_prompt_start
    try:
        return VllmSamplingParams(**kwargs)
    except (ValueError, VLLMValidationError) as exc:
        # vLLM's own checks, for any combination the contract's ranges do not cover.
        raise InvalidArgument(f"sampling_params rejected: {exc}") from exc


def structured_outputs_params(constraint: generation_pb2.StructuredOutput) -> Any:
    """vLLM's StructuredOutputsParams for a validated constraint."""
    import json

    from vllm.sampling_params import StructuredOutputsParams

    kind = constraint.WhichOneof("constraint")
    if kind == "json_schema":
        return StructuredOutputsParams(json=json.loads(constraint.json_schema))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=constraint.regex)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(constraint.choice.choices))
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=constraint.structural_tag)
    return StructuredOutputsParams(grammar=constraint.grammar)


class _LogprobEntry(Protocol):
    logprob: float
    rank: int | None


def logprobs_to_proto(
    token_ids: Sequence[int],
    positions: Iterable[Mapping[int, _LogprobEntry] | None],
    top_k: int,
) -> generation_pb2.Logprobs:
    """vLLM's logprobs (flat lists, or per-position ``{token_id: Logprob}`` maps) as the
    contract's Logprobs.

    A position without data (the first prompt token) is reported as 0 with no alternatives.
    """
    if hasattr(positions, "start_indices"):
        return _flat_logprobs_to_proto(positions, top_k)
    result = generation_pb2.Logprobs()
    for token_id, position in zip(token_ids, positions, strict=False):
        if position is None:
            result.token_logprobs.append(0.0)
            if top_k:
                result.top_logprobs.add()
            continue
        entry = position.get(token_id)
        result.token_logprobs.append(entry.logprob if entry is not None else float("-inf"))
        if top_k:
            ranked = sorted(
                (
                    (e.rank if e.rank is not None else 1 << 30, t, e.logprob)
                    for t, e in position.items()
                ),
            )[:top_k]
            top = result.top_logprobs.add()
            top.token_ids.extend(t for _, t, _ in ranked)
            top.logprobs.extend(lp for _, _, lp in ranked)
    return result


def _flat_logprobs_to_proto(flat: Any, top_k: int) -> generation_pb2.Logprobs:
    """vLLM's ``FlatLogprobs``: per position, the sampled (or prompt) token's entry first,
    then the top ``k`` by rank -- without the sampled token when it is one of them (it is
    listed once). So the alternatives are the ``k`` most likely of all the position's entries,
    the sampled token among them when it ranks there; a position without data has none."""
    result = generation_pb2.Logprobs()
    starts, ends = flat.start_indices, flat.end_indices
    values = flat.logprobs
    result.token_logprobs.extend(
        values[start] if end > start else 0.0 for start, end in zip(starts, ends, strict=True)
    )
    if top_k:
        ids = flat.token_ids
        for start, end in zip(starts, ends, strict=True):
            top = result.top_logprobs.add()
            entries = {ids[i]: values[i] for i in range(start, end)}
            ranked = sorted(entries.items(), key=lambda entry: -entry[1])[:top_k]
            top.token_ids.extend(t for t, _ in ranked)
            top.logprobs.extend(lp for _, lp in ranked)
    return result


def finish_to_proto(
    finish_reason: str | None, stop_reason: int | str | None, token_ids: Sequence[int]
) -> tuple[generation_pb2.FinishReason, generation_pb2.StopMatch | None]:
    """vLLM's finish/stop reasons as the contract's FinishReason and StopMatch."""
    reason = finish_reasons.to_proto(finish_reason)
    if reason == generation_pb2.FINISH_REASON_UNSPECIFIED:
        return reason, None
    if reason != generation_pb2.FINISH_REASON_STOP:
        return reason, None
    if isinstance(stop_reason, str):
        return reason, generation_pb2.StopMatch(text=stop_reason)
    if isinstance(stop_reason, int):
        return reason, generation_pb2.StopMatch(token_id=stop_reason)
    # None with "stop" means EOS: the sample's last token is the EOS id.
    return reason, generation_pb2.StopMatch(token_id=token_ids[-1]) if token_ids else None


class StreamConverter:
    """Turns one request's vLLM ``RequestOutput`` deltas into the contract's stream chunks."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: VllmSamplingParams,
        include_text: bool,
        routed_experts: bool = False,
        routed_experts_as_sets: bool = False,
    ) -> None:
        self.request_id = request_id
        # Whether the request asked for its routed experts (vLLM captures every request's),
        # and packed as sets (SamplingParams.routed_experts_as_sets).
        self._routed_experts = routed_experts
        self._routed_experts_as_sets = routed_experts_as_sets
        self._prompt_token_ids = prompt_token_ids
        self._logprobs = sampling_params.logprobs
        self._prompt_logprobs = sampling_params.prompt_logprobs
        self._include_text = include_text
        self._usage = generation_pb2.Usage(prompt_tokens=len(prompt_token_ids))
        self._prompt_logprobs_sent = False

    def chunks(
        self, output: Any, weight_version: int
    ) -> list[data_plane_pb2.GenerateStreamResponse]:
        result = []
        if output.num_cached_tokens:
            self._usage.cached_prompt_tokens = output.num_cached_tokens
        for completion in output.outputs:
            token_ids = completion.token_ids
            if not token_ids and completion.finish_reason is None:
                continue
            self._usage.completion_tokens += len(token_ids)
            chunk = data_plane_pb2.GenerateStreamResponse(
                request_id=self.request_id,
                sample_index=completion.index,
                token_ids=token_ids,
                weight_version=weight_version,
            )
            if self._logprobs is not None and completion.logprobs is not None:
                chunk.logprobs.CopyFrom(
                    logprobs_to_proto(token_ids, completion.logprobs, self._logprobs)
                )
            reason, stop = finish_to_proto(
                completion.finish_reason, completion.stop_reason, completion.token_ids
            )
            chunk.finish_reason = reason
            if stop is not None:
                chunk.stop.CopyFrom(stop)
            if self._include_text and completion.text:
                chunk.text = completion.text
            experts = getattr(completion, "routed_experts", None)  # its steps' rows
            if self._routed_experts and experts is not None:  # as sets once sent: ``sendable``
                chunk.routed_experts.CopyFrom(routed_experts.pack(experts))
            chunk.usage.CopyFrom(self._usage)
            result.append(chunk)
        if result:
            if not self._prompt_logprobs_sent and self._prompt_logprobs is not None:
                self._prompt_logprobs_sent = True
                if output.prompt_logprobs is not None:
                    result[0].prompt_logprobs.CopyFrom(
                        logprobs_to_proto(
                            self._prompt_token_ids, output.prompt_logprobs, self._prompt_logprobs
                        )
                    )
        return result

    def sendable(self, message: data_plane_pb2.GenerateStreamResponse) -> None:
        """``message`` (the steps merged into one) as it leaves: its routed experts packed as
        sets where the request asked, once per message rather than per step (the steps'
        ordered rows are joined as a copy)."""
        if self._routed_experts_as_sets and message.HasField("routed_experts"):
            message.routed_experts.CopyFrom(routed_experts.as_sets(message.routed_experts))


class ChunkCoalescer:
    """Holds a sample's stream chunks back until ``interval`` new tokens have accumulated.

    Each message costs a serialization here, a relay in the router and a parse in the client;
    merging consecutive chunks cuts that cost by the interval. A sample's first chunk (time to
    first token), its last (finish reason) and a change of weight version (so every message
    still names the one version that produced its tokens) are never held back.
    """

    def __init__(self, interval: int) -> None:
        self._interval = interval
        self._pending: dict[int, data_plane_pb2.GenerateStreamResponse] = {}
        self._started: set[int] = set()

    def push(
        self, chunk: data_plane_pb2.GenerateStreamResponse
    ) -> list[data_plane_pb2.GenerateStreamResponse]:
        """The chunks to send now, oldest first, given the engine's next chunk."""
        if self._interval <= 1:
            return [chunk]
        ready = []
        index = chunk.sample_index
        pending = self._pending.pop(index, None)
        if pending is not None:
            if pending.weight_version != chunk.weight_version:
                ready.append(pending)
            else:
                merge_into(pending, chunk)
                chunk = pending
        first = index not in self._started
        self._started.add(index)
        if first or chunk.finish_reason or len(chunk.token_ids) >= self._interval:
            ready.append(chunk)
        else:
            self._pending[index] = chunk
        return ready


# -- what the engine says about itself ----------------------------------------------------------


def lora_adapter_to_proto(adapter: LoadedAdapter) -> lora_pb2.LoraAdapter:
    return lora_pb2.LoraAdapter(
        name=adapter.name,
        version=adapter.version,
        rank=adapter.config.rank,
        target_modules=list(adapter.config.target_modules),
        lora_alpha=adapter.config.alpha,
        source=adapter.source,
        sha256=adapter.sha256,
    )


def model_info_to_proto(model: ModelDescription) -> data_plane_pb2.GetModelInfoResponse:
    response = data_plane_pb2.GetModelInfoResponse(
        served_model_name=model.served_model_name,
        vocab_size=model.vocab_size,
        eos_token_ids=model.eos_token_ids,
        max_context_length=model.max_context_length,
        has_chat_template=model.has_chat_template,
        lora_adapters=[lora_adapter_to_proto(a) for a in model.lora_adapters],
    )
    if model.bos_token_id is not None:
        response.bos_token_id = model.bos_token_id
    if model.pad_token_id is not None:
        response.pad_token_id = model.pad_token_id
    return response
