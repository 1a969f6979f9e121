"""What an engine says about itself, as plain values: the model (GetModelInfo) and the server
(GetServerInfo). The vLLM adapter fills them in; ``convert`` builds the contract's messages."""

from __future__ import annotations

from dataclasses import dataclass

from .adapters import AdapterLimits, LoadedAdapter

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(frozen=True)
class ModelDescription:
    served_model_name: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    max_context_length: int
    has_chat_template: bool
    lora_adapters: list[LoadedAdapter]


@dataclass(frozen=True)
class ServerDescription:
    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    # Ranks the server takes in a weight-transfer group: one per tensor-parallel group (the
    # worker keeping the checkpoint copy; ``weights.transfer_engine``).
    weight_group_ranks: int
    sleep_supported: bool
    # How weights can arrive, best first: "nccl", "gloo", "grpc_stream".
    weight_transfer_backends: list[str]
    prefix_caching: bool
    lora: AdapterLimits
    weight_version: int
    engine: str
    engine_version: str
    served_model_name: str
    device: str
    pause_modes: tuple[str, ...] = PAUSE_MODES
