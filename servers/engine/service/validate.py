"""Every check an engine server applies to a request, before anything reaches the engine.

Pure functions of plain values and protobuf messages (no engine, no gRPC context), each raising
``InvalidArgument`` with a message that names the field, the value and what would be accepted.
Servicers call these; ``data_convert`` then builds engine types from requests that passed, and the
vLLM adapter (``vllm_engine``) knows no request rules. Checks shared with the router (addresses,
ports) are in ``servers.common.addresses``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from servers.common import addresses as common
from servers.engine.transfer.protocol import Group
from servers.engine.vllm_adapter.vllm_engine import PauseModeName
from skyrl_grpc.batch_shape import batch_shape
from skyrl_grpc.errors import FailedPrecondition, InvalidArgument
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import data_plane_pb2, generation_pb2

CollectiveBackend = Literal["gloo", "nccl"]

PAUSE_MODES: dict[int, PauseModeName] = {
    cp.PAUSE_MODE_UNSPECIFIED: "abort",
    cp.PAUSE_MODE_ABORT: "abort",
    cp.PAUSE_MODE_WAIT: "wait",
    cp.PAUSE_MODE_KEEP: "keep",
}
COLLECTIVE_BACKENDS: dict[int, CollectiveBackend] = {
    cp.WEIGHT_TRANSFER_BACKEND_GLOO: "gloo",
    cp.WEIGHT_TRANSFER_BACKEND_NCCL: "nccl",
}
DEFAULT_GROUP_TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts, and the server's own request limits
    (``options.RequestLimits``, resolved against the model)."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    # Prompt tokens per request: at most the context minus one (``--max-prompt-tokens``).
    max_prompt_tokens: int = 0
    max_n: int = 128
    max_request_id_bytes: int = 256
    # Whether vLLM captures the experts each MoE layer routes tokens to
    # (--enable-return-routed-experts).
    routed_experts: bool = False

    def __post_init__(self) -> None:
        room = self.max_model_len - 1
        if not 0 < self.max_prompt_tokens <= room:
            object.__setattr__(self, "max_prompt_tokens", room)


# -- data plane ------------------------------------------------------------------------------


def token_ids(ids: Sequence[int], limits: ModelLimits, field: str) -> None:
    """Every id is inside the vocabulary."""
    for position, token in enumerate(ids):
        if token >= limits.vocab_size:
            raise InvalidArgument(
                f"{field}[{position}] = {token} is outside the vocabulary: "
                f"token ids must be in 0..{limits.vocab_size - 1}"
            )


def prompt_length(count: int, limits: ModelLimits) -> None:
    """A prompt of ``count`` tokens fits (checked before the ids are even read)."""
    if count > limits.max_prompt_tokens:
        if limits.max_prompt_tokens == limits.max_model_len - 1:
            raise InvalidArgument(
                f"the prompt has {count} tokens but the model's context is "
                f"{limits.max_model_len} tokens (prompt plus at least one output token): "
                "shorten the prompt"
            )
        raise InvalidArgument(
            f"the prompt has {count} tokens; this server takes at most "
            f"{limits.max_prompt_tokens} (--max-prompt-tokens)"
        )


def prompt(ids: Sequence[int], limits: ModelLimits, field: str) -> list[int]:
    """A tokenized prompt: non-empty, within the prompt limit, in the vocabulary."""
    if not ids:
        raise InvalidArgument(f"{field} is empty: send at least one token id")
    prompt_length(len(ids), limits)  # before any pass over the ids
    result = list(ids)
    if max(result) >= limits.vocab_size:
        token_ids(result, limits, field)
    return result


def text_length(text: str, limits: ModelLimits, longest_token_bytes: int, field: str) -> None:
    """Text that cannot fit the prompt limit whatever it tokenizes to (every token covers at
    most ``longest_token_bytes`` bytes) is refused before the tokenizer runs."""
    if len(text) * 4 <= limits.max_prompt_tokens * longest_token_bytes:
        return  # even at 4 bytes per character it would fit: do not measure
    size = len(text.encode())
    if size > limits.max_prompt_tokens * longest_token_bytes:
        raise InvalidArgument(
            f"{field} is {size} bytes: more than {limits.max_prompt_tokens} tokens of this "
            f"model's tokenizer can hold (--max-prompt-tokens): shorten it"
        )


def sample_count(n: int, limits: ModelLimits) -> int:
    """The contract's ``n`` (0 means 1) as a sample count."""
    if n < 0:
        raise InvalidArgument(f"n = {n}: the number of samples must be >= 1 (0 means 1)")
    if n > limits.max_n:
        raise InvalidArgument(f"n = {n}: this server takes at most {limits.max_n} (--max-n)")
    return n or 1


def request_id(value: str, limits: ModelLimits) -> None:
    if len(value) > limits.max_request_id_bytes or len(value.encode()) > (
        limits.max_request_id_bytes
    ):
        raise InvalidArgument(
            f"request_id is {len(value.encode())} bytes; this server takes at most "
            f"{limits.max_request_id_bytes} (--max-request-id-bytes)"
        )


def batch(
    request: data_plane_pb2.GenerateBatchRequest, capacity: int | None
) -> tuple[list[int], list[str]]:
    """A batch's shape: some requests, no more than the server holds at once (``capacity``;
    None: any number, each admitted or refused alone), and ``indices`` / ``session_ids`` each
    empty or one per request. Returns every request's index and session ("" for none). Each
    request's own checks come later, one by one."""
    indices, sessions = batch_shape(request)
    if capacity is not None and len(indices) > capacity:
        raise InvalidArgument(
            f"the batch has {len(indices)} requests; this server runs and queues at most "
            f"{capacity} (--max-concurrent-samples plus --max-queued-requests): split the batch"
        )
    return indices, sessions


def weight_floor(min_weight_version: int, serving: int) -> None:
    """A continuation (``min_weight_version``) goes on only here where this server's weights
    are at least as new as its tokens' (its versions never go backwards)."""
    if min_weight_version < 0:
        raise InvalidArgument(f"min_weight_version must be >= 0, got {min_weight_version}")
    if min_weight_version > serving:
        raise FailedPrecondition(
            f"this server serves weight version {serving}, older than the request's "
            f"min_weight_version {min_weight_version} (it continues a sample made at that "
            "version): send it to a server that has the update (the router and the trainer "
            "client place it so)"
        )


def session_id(value: str) -> None:
    if not value:
        raise InvalidArgument("session_id is empty: name the session to finish")


def chat_messages(messages: Sequence[data_plane_pb2.ChatMessage]) -> None:
    if not messages:
        raise InvalidArgument("messages is empty: send at least one chat message")


def _in_range(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    too_low = value <= low if low_open else value < low
    if math.isnan(value) or too_low or value > high:
        bracket = "(" if low_open else "["
        raise InvalidArgument(
            f"sampling_params.{name} = {value} is outside {bracket}{low}, {high}]"
        )


def sampling(params: generation_pb2.SamplingParams, *, prompt_len: int, limits: ModelLimits) -> int:
    """Checks every sampling field against its documented range; returns the ``max_tokens``
    to generate (the context's room when unset)."""
    room = limits.max_model_len - prompt_len
    if params.return_routed_experts and not limits.routed_experts:
        raise FailedPrecondition(
            "sampling_params.return_routed_experts: this server does not capture routed experts; "
            "start it with --enable-return-routed-experts (vLLM's flag, on an engine that can)"
        )
    if any(not s for s in params.stop_strings):
        raise InvalidArgument("sampling_params.stop_strings contains an empty string")
    token_ids(params.stop_token_ids, limits, "sampling_params.stop_token_ids")
    if params.HasField("temperature") and (
        math.isnan(params.temperature) or params.temperature < 0
    ):
        raise InvalidArgument(
            f"sampling_params.temperature = {params.temperature}: must be >= 0 (0 = greedy)"
        )
    if params.HasField("top_p"):
        _in_range("top_p", params.top_p, 0.0, 1.0, low_open=True)
    if params.HasField("top_k") and params.top_k < -1:
        raise InvalidArgument(
            f"sampling_params.top_k = {params.top_k}: must be >= 1, or 0 / -1 to disable"
        )
    if params.HasField("min_p"):
        _in_range("min_p", params.min_p, 0.0, 1.0)
    max_tokens = room
    if params.HasField("max_tokens"):
        if params.max_tokens <= 0:
            raise InvalidArgument(
                f"sampling_params.max_tokens = {params.max_tokens}: must be >= 1 "
                f"(unset means as many as the context allows, here {room})"
            )
        if params.max_tokens > room:
            raise InvalidArgument(
                f"sampling_params.max_tokens = {params.max_tokens} plus the {prompt_len}-token "
                f"prompt exceeds the model's {limits.max_model_len}-token context: "
                f"use max_tokens <= {room}"
            )
        max_tokens = params.max_tokens
    if params.HasField("min_tokens") and not 0 <= params.min_tokens <= max_tokens:
        raise InvalidArgument(
            f"sampling_params.min_tokens = {params.min_tokens}: must be in "
            f"0..max_tokens ({max_tokens})"
        )
    for penalty in ("presence_penalty", "frequency_penalty"):
        if params.HasField(penalty):
            _in_range(penalty, getattr(params, penalty), -2.0, 2.0)
    token_ids(list(params.logit_bias), limits, "sampling_params.logit_bias")
    for token, bias in params.logit_bias.items():
        if math.isnan(bias) or not -100.0 <= bias <= 100.0:
            raise InvalidArgument(
                f"sampling_params.logit_bias[{token}] = {bias}: must be in -100..100"
            )
    token_ids(params.allowed_token_ids, limits, "sampling_params.allowed_token_ids")
    if params.HasField("structured_output"):
        structured_output(params.structured_output)
    if params.HasField("repetition_penalty"):
        _in_range("repetition_penalty", params.repetition_penalty, 0.0, 1e6, low_open=True)
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name):
            value = getattr(params, name)
            if value < 0 or value > limits.max_logprobs:
                raise InvalidArgument(
                    f"sampling_params.{name} = {value}: must be in 0..{limits.max_logprobs} "
                    "(--max-logprobs)"
                )
    return max_tokens


# -- control plane ---------------------------------------------------------------------------


def pause_mode(mode: int) -> PauseModeName:
    """The engine's name for a PauseMode value (unset means ABORT)."""
    try:
        return PAUSE_MODES[mode]
    except KeyError:
        raise InvalidArgument(
            f"mode = {mode} is not a PauseMode: use ABORT (1), WAIT (2) or KEEP (3)"
        ) from None


def sleep_level(level: int) -> int:
    """The contract's sleep level (0 means 1)."""
    resolved = level or 1
    if resolved not in (1, 2):
        raise InvalidArgument(f"level = {level}: sleep level must be 1 or 2")
    return resolved


def weight_transfer_group(request: cp.InitWeightTransferRequest) -> Group:
    """How this server's workers join the trainer's group, from a valid InitWeightTransfer."""
    backend = COLLECTIVE_BACKENDS.get(request.backend)
    if backend is None:
        raise InvalidArgument(
            f"backend = {request.backend}: InitWeightTransfer takes GLOO (1) or NCCL (2); "
            "GRPC_STREAM needs no group: use PushWeights"
        )
    if not request.master_address:
        raise InvalidArgument("master_address is required: the trainer's rendezvous host")
    common.port(request.master_port, "master_port")
    if request.rank_offset < 1 or request.world_size <= request.rank_offset:
        raise InvalidArgument(
            f"rank_offset = {request.rank_offset}, world_size = {request.world_size}: "
            "rank 0 is the trainer, so rank_offset >= 1 and world_size > rank_offset"
        )
    return Group(
        backend=backend,
        master_address=request.master_address,
        master_port=request.master_port,
        rank_offset=request.rank_offset,
        world_size=request.world_size,
        group_name=request.group_name or "default",
        timeout_seconds=float(request.timeout_seconds or DEFAULT_GROUP_TIMEOUT_SECONDS),
    )


# The most bytes a structured-output constraint may have: compiling one costs engine time.
MAX_CONSTRAINT_BYTES = 64 * 1024


def structured_output(constraint: generation_pb2.StructuredOutput) -> None:
    """A constraint the engine can compile: one of them, not too large, a JSON schema that is
    a JSON object, a regex that compiles, a non-empty choice."""
    kind = constraint.WhichOneof("constraint")
    if kind is None:
        raise InvalidArgument(
            "sampling_params.structured_output is set but empty: set json_schema, "
            "json_object, regex, choice, grammar or structural_tag"
        )
    text = {
        "json_schema": constraint.json_schema,
        "regex": constraint.regex,
        "grammar": constraint.grammar,
        "structural_tag": constraint.structural_tag,
    }.get(kind, "")
    size = len(text.encode()) + sum(len(c.encode()) for c in constraint.choice.choices)
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidArgument(
            f"sampling_params.structured_output.{kind} has {size} bytes; the limit is "
            f"{MAX_CONSTRAINT_BYTES}"
        )
    if kind in ("json_schema", "structural_tag"):
        try:
            schema = json.loads(text)
        except ValueError as error:
            raise InvalidArgument(
                f"sampling_params.structured_output.{kind} is not valid JSON: {error}"
            ) from None
        if not isinstance(schema, dict):
            raise InvalidArgument(f"sampling_params.structured_output.{kind} must be a JSON object")
    elif kind == "json_object" and not constraint.json_object:
        raise InvalidArgument("sampling_params.structured_output.json_object must be true")
    elif kind == "regex":
        try:
            re.compile(constraint.regex)
        except re.error as error:
            raise InvalidArgument(
                f"sampling_params.structured_output.regex does not compile: {error}"
            ) from None
    elif kind == "choice" and not constraint.choice.choices:
        raise InvalidArgument("sampling_params.structured_output.choice lists no choice")
    elif kind == "grammar" and not constraint.grammar.strip():
        raise InvalidArgument("sampling_params.structured_output.grammar is empty")
