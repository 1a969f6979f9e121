"""vLLM's ``Control`` service (its Rust front end's gRPC contract, package ``vllm``) to and from
this stack's ControlPlane messages, for ``service.vllm_api``: pause modes, versions (vLLM's
strings, this server's numbers), the JSON of vLLM's NCCL weight-transfer engine as this stack's
collective group and buckets, and what GetServerInfo / GetModelInfo / the LoRA calls answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from servers.engine.domain.descriptions import ModelDescription, ServerDescription
from servers.engine.service.vllm_inference_convert import unsupported
from servers.engine.vllm_adapter.scheduling import SchedulingLimits
from skyrl_grpc import dtypes
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import lora_pb2
from skyrl_grpc.vllm_api import control_pb2 as vc

# The service's full name ("vllm.Control").
CONTROL: str = vc.DESCRIPTOR.services_by_name["Control"].full_name
# What ServerInfo.api_version says, as vLLM's front end says it.
API_VERSION = "vllm"
# vLLM's packed broadcast: its default bucket size (vllm.distributed.weight_transfer).
VLLM_PACKED_BUFFER_BYTES = 1 << 30
_PAUSE_MODES = {
    vc.PAUSE_MODE_UNSPECIFIED: cp.PAUSE_MODE_ABORT,  # vLLM's front end: unspecified is abort
    vc.PAUSE_MODE_ABORT: cp.PAUSE_MODE_ABORT,
    vc.PAUSE_MODE_WAIT: cp.PAUSE_MODE_WAIT,
    vc.PAUSE_MODE_KEEP: cp.PAUSE_MODE_KEEP,
}


def pause_request(mode: int, clear_cache: bool | None) -> cp.PauseRequest:
    ours = _PAUSE_MODES.get(mode)  # type: ignore[call-overload]
    if ours is None:
        raise InvalidArgument(f"mode = {mode}: not a PauseMode (ABORT 1, WAIT 2, KEEP 3)")
    # vLLM's front end clears the prefix cache on a pause unless told not to.
    return cp.PauseRequest(mode=ours, clear_cache=True if clear_cache is None else clear_cache)


def weight_version(text: str, field: str) -> int:
    """vLLM names weight versions with strings; this server numbers them (int64, the version on
    every token it streams), so a vLLM client sends the number as text."""
    try:
        return int(text.strip())
    except ValueError:
        raise InvalidArgument(
            f"{field} = {text!r}: this server numbers its weight versions; send the new "
            "version as a decimal integer (GetWeightVersion says the serving one)"
        ) from None


def json_object(data: bytes, field: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise InvalidArgument(f"{field} must contain valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field} must contain a JSON object")
    return value


_REQUIRED = object()


def _take(info: dict[str, Any], key: str, kind: type, field: str, default: Any = _REQUIRED) -> Any:
    """``info[key]`` if it is a JSON value of ``kind`` (``default`` when absent, if given)."""
    value = info.get(key, default)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise InvalidArgument(f"{field}.{key} must be a JSON {kind.__name__}, got {value!r}")
    return value


def _count(
    info: dict[str, Any], key: str, field: str, default: Any = _REQUIRED, limit: int = 1 << 32
) -> int:
    """``info[key]`` as a whole number in 0 .. ``limit`` - 1."""
    value: int = _take(info, key, int, field, default)
    if not 0 <= value < limit:
        raise InvalidArgument(f"{field}.{key} = {value}: must be in 0 .. {limit - 1}")
    return value


@dataclass(frozen=True)
class Packing:
    """How the trainer lays out its broadcasts (vLLM's init info: ``packed``): one broadcast per
    tensor, or tensors packed into byte buffers of ``buffer_bytes`` or just over."""

    packed: bool = False
    buffer_bytes: int = VLLM_PACKED_BUFFER_BYTES


_INIT_KEYS = {
    "master_address", "master_port", "rank_offset", "world_size", "packed",
    "packed_buffer_size_bytes", "packed_num_buffers", "backend", "group_name", "timeout_seconds",
}  # fmt: skip
_BACKENDS = {"gloo": cp.WEIGHT_TRANSFER_BACKEND_GLOO, "nccl": cp.WEIGHT_TRANSFER_BACKEND_NCCL}


def init_weight_transfer(
    data: bytes, default_backend: str
) -> tuple[cp.InitWeightTransferRequest, Packing]:
    """vLLM's NCCL init info (``master_address``, ``master_port``, ``rank_offset``,
    ``world_size``, ``packed``...) as this stack's InitWeightTransfer: the same group, joined
    as the ControlPlane joins it (``backend`` defaults to the server's best: NCCL on GPUs, gloo on
    CPU; ``group_name`` to "default")."""
    field = "init_info_json"
    info = json_object(data, field)
    if "nccl_unique_id_b64" in info:
        raise unsupported(
            f"{field}.nccl_unique_id_b64",
            "the trainer's group meets at a rendezvous store: send master_address and master_port",
        )
    unknown = sorted(set(info) - _INIT_KEYS)
    if unknown:
        raise InvalidArgument(f"{field}: unknown keys {unknown}; it takes {sorted(_INIT_KEYS)}")
    backend = info.get("backend", default_backend)
    if backend not in _BACKENDS:
        raise InvalidArgument(f"{field}.backend = {backend!r}: gloo or nccl")
    request = cp.InitWeightTransferRequest(
        backend=_BACKENDS[backend],
        master_address=_take(info, "master_address", str, field),
        master_port=_count(info, "master_port", field),
        rank_offset=_count(info, "rank_offset", field),
        world_size=_count(info, "world_size", field),
        group_name=_take(info, "group_name", str, field, ""),
        timeout_seconds=_count(info, "timeout_seconds", field, 0),
    )
    packing = Packing(
        packed=_take(info, "packed", bool, field, False),
        buffer_bytes=_count(
            info, "packed_buffer_size_bytes", field, VLLM_PACKED_BUFFER_BYTES, limit=1 << 62
        ),
    )
    return request, packing


def _parameter(name: str, dtype_name: str, shape: list[int], where: str) -> cp.ParameterSpec:
    info = dtypes.BY_TORCH.get(str(dtype_name).removeprefix("torch."))
    if info is None:
        raise InvalidArgument(
            f"{where}: dtype {dtype_name!r} cannot be transferred; "
            f"use one of {sorted(dtypes.BY_TORCH)}"
        )
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{where}: the name must be a non-empty string, got {name!r}")
    sizes = isinstance(shape, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape
    )
    if not sizes:
        raise InvalidArgument(f"{where}: shape {shape!r} is not a list of sizes")
    return cp.ParameterSpec(name=name, dtype=info.proto, shape=shape)


def update_weights(data: bytes, packing: Packing) -> cp.UpdateWeightsRequest:
    """vLLM's NCCL update info (``names``, ``dtype_names``, ``shapes``) as this stack's
    buckets, in the order vLLM's trainer broadcasts them: one per tensor, or, packed, tensors
    added to a bucket until it holds more than the buffer size (vLLM's ``pack_tensors``)."""
    field = "update_info_json"
    info = json_object(data, field)
    names = _take(info, "names", list, field)
    dtype_names = _take(info, "dtype_names", list, field)
    shapes = _take(info, "shapes", list, field)
    if not len(names) == len(dtype_names) == len(shapes):
        raise InvalidArgument(
            f"{field}: names ({len(names)}), dtype_names ({len(dtype_names)}) and shapes "
            f"({len(shapes)}) must have one entry per tensor"
        )
    request = cp.UpdateWeightsRequest()
    bucket: cp.WeightBucket | None = None
    for i, (name, dtype_name, shape) in enumerate(zip(names, dtype_names, shapes, strict=True)):
        spec = _parameter(name, dtype_name, shape, f"{field}.names[{i}] ({name})")
        size = dtypes.num_bytes(shape, dtypes.from_proto(spec.dtype))
        if size >= 1 << 48:
            raise InvalidArgument(f"{field}.names[{i}] ({name}): shape {shape} is no parameter's")
        if bucket is None:
            bucket = request.buckets.add()
        bucket.parameters.add(parameter=spec, offset_bytes=bucket.size_bytes)
        bucket.size_bytes += size
        if not packing.packed or bucket.size_bytes > packing.buffer_bytes:
            bucket = None
    return request


def transfer_backend(server: ServerDescription) -> str:
    """The collective backend a vLLM client's group gets here: the server's best."""
    return next((b for b in server.weight_transfer_backends if b in _BACKENDS), "gloo")


def server_info(
    server: ServerDescription,
    model: ModelDescription,
    instance_id: str,
    scheduling: SchedulingLimits,
) -> vc.ServerInfo:
    return vc.ServerInfo(
        engine_version=server.engine_version,
        api_version=API_VERSION,
        instance_id=instance_id,
        parallelism=vc.ParallelismInfo(
            tensor_parallel_size=server.tensor_parallel_size,
            pipeline_parallel_size=server.pipeline_parallel_size,
            data_parallel_size=server.data_parallel_size,
            world_size=server.world_size,
            data_parallel_size_local=server.data_parallel_size,
        ),
        max_model_len=model.max_context_length,
        kv_block_size=scheduling.block_size,
        total_kv_blocks=scheduling.total_blocks,
        max_running_requests=scheduling.max_num_seqs,
        max_batched_tokens=scheduling.max_batched_tokens,
        max_loras=server.lora.max_loras if server.lora.enabled else 0,
        rl_capabilities=vc.RlCapabilities(
            weight_transfer_enabled=True,
            weight_transfer_backend=transfer_backend(server),
            sleep_mode_enabled=server.sleep_supported,
            draft_weight_updates_enabled=False,
        ),
    )


def model_info(
    model: ModelDescription, server: ServerDescription, tool_parser: str, reasoning_parser: str
) -> vc.ModelInfo:
    return vc.ModelInfo(
        model_id=model.served_model_name,
        served_model_name=model.served_model_name,
        supports_text_input=True,
        supports_token_ids_input=True,
        supports_lora=server.lora.enabled,
        supports_multimodal=False,
        tool_call_parser=tool_parser,
        reasoning_parser=reasoning_parser,
    )


def lora_adapter(adapter: lora_pb2.LoraAdapter, source_path: str = "") -> vc.LoraAdapter:
    """An adapter as vLLM lists it: its id is the adapter's version here (loading a name again
    replaces it with a new version); the directory only where the call named it (an adapter
    pushed in-band has none, and the server keeps no path)."""
    return vc.LoraAdapter(lora_id=adapter.version, lora_name=adapter.name, source_path=source_path)
