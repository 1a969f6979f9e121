"""What an engine says about itself, as plain values: the model (GetModelInfo), the server
(GetServerInfo) and its serving status (what ServerStatus streams to placers). The builder
(``process.engine_parts``) fills them in from the domain and the vLLM adapter; the service's
converters build the contract's messages."""

from __future__ import annotations

from dataclasses import dataclass

from servers.engine.domain.lora_adapters import AdapterLimits, LoadedAdapter
from servers.engine.domain.weights.staging import OpenUpdate
from servers.engine.domain.weights.update_log import UpdateRecord
from servers.engine.transfer.protocol import Group

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
    # worker keeping the checkpoint copy; ``worker.transfer_engine``).
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
    # This project's version, as the server reports it.
    server_version: str = ""
    pause_modes: tuple[str, ...] = PAUSE_MODES
    # The weight update open here (None: none), the version a rollback returns to (None:
    # nothing kept) and the weight-transfer group joined (None: none).
    open_update: OpenUpdate | None = None
    rollback_version: int | None = None
    group: Group | None = None
    # Whether requests may ask for their routed experts (``--enable-return-routed-experts``).
    routed_experts: bool = False


@dataclass(frozen=True)
class ServingStatus:
    """What placers follow (ServerStatus): pause, version, load, cache, live sessions."""

    paused: bool
    weight_version: int
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    prompt_tokens: int
    cached_prompt_tokens: int
    sessions: frozenset[str]
    adapters: tuple[str, ...] = ()
    recent_updates: tuple[UpdateRecord, ...] = ()
