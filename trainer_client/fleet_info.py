"""What the control and model-info calls return: plain dataclasses read from the servers'
answers, so a trainer needs no protobuf (the conversions are the ``from_proto`` methods)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum

from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import data_plane_pb2, lora_pb2
from trainer_client.exceptions import Unsupported


class PauseMode(StrEnum):
    """How ``pause`` treats running generations (the values SkyRL's PauseMode uses)."""

    ABORT = "abort"  # end them now with finish reason ABORTED (the client resubmits them)
    WAIT = "wait"  # let them finish; new ones wait
    KEEP = "keep"  # freeze them where they are; they go on after resume

    def to_proto(self) -> cp.PauseMode:
        return _PAUSE_MODES[self]


_PAUSE_MODES = {
    PauseMode.ABORT: cp.PAUSE_MODE_ABORT,
    PauseMode.WAIT: cp.PAUSE_MODE_WAIT,
    PauseMode.KEEP: cp.PAUSE_MODE_KEEP,
}


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter a server holds."""

    name: str
    version: int
    rank: int
    target_modules: tuple[str, ...]
    lora_alpha: float
    source: str  # how it was loaded: "in-band" or "path"
    sha256: bytes  # of its tensors, as the server holds them

    @classmethod
    def from_proto(cls, adapter: lora_pb2.LoraAdapter) -> LoraAdapter:
        return cls(
            name=adapter.name,
            version=adapter.version,
            rank=adapter.rank,
            target_modules=tuple(adapter.target_modules),
            lora_alpha=adapter.lora_alpha,
            source=adapter.source,
            sha256=adapter.sha256,
        )


@dataclass(frozen=True)
class ModelInfo:
    """The served model, as the tokenizer and engine describe it."""

    served_model_name: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    max_context_length: int
    has_chat_template: bool
    lora_adapters: tuple[LoraAdapter, ...]

    @classmethod
    def from_proto(cls, info: data_plane_pb2.GetModelInfoResponse) -> ModelInfo:
        return cls(
            served_model_name=info.served_model_name,
            vocab_size=info.vocab_size,
            bos_token_id=info.bos_token_id if info.HasField("bos_token_id") else None,
            eos_token_ids=tuple(info.eos_token_ids),
            pad_token_id=info.pad_token_id if info.HasField("pad_token_id") else None,
            max_context_length=info.max_context_length,
            has_chat_template=info.has_chat_template,
            lora_adapters=tuple(LoraAdapter.from_proto(a) for a in info.lora_adapters),
        )


@dataclass(frozen=True)
class LoraCapabilities:
    enabled: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


@dataclass(frozen=True)
class Capabilities:
    """What a server can do."""

    sleep: bool
    weight_transfer_backends: tuple[str, ...]  # "gloo", "nccl", "grpc_stream"
    pause_modes: tuple[PauseMode, ...]
    prefix_caching: bool
    lora: LoraCapabilities
    # The gRPC services it answers, by full name (this package's, and vLLM's own
    # "vllm.grpc.engine.VllmEngine"); empty from a server older than the field.
    protocols: tuple[str, ...] = ()
    # Whether a request may ask for the experts its tokens were routed to.
    routed_experts: bool = False

    def cannot_return_routed_experts(self) -> str | None:
        """Why a request asking for its routed experts is refused here (None: it is not)."""
        if self.routed_experts:
            return None
        return "captures no routed experts: start it with --enable-return-routed-experts"

    def cannot_sleep(self, device: str) -> str | None:
        """Why ``sleep`` is refused here (None: it is not)."""
        if self.sleep:
            return None
        return f"has no sleep mode (its engine runs on {device}; vLLM sleeps on GPUs)"

    def cannot_load_lora(self) -> str | None:
        """Why loading a LoRA adapter is refused here (None: it is not)."""
        return None if self.lora.enabled else "serves no LoRA adapters: start it with --enable-lora"

    def cannot_join(self, backend: str) -> str | None:
        """Why joining a ``backend`` weight-transfer group is refused here (None: it is not)."""
        if backend in self.weight_transfer_backends:
            return None
        takes = ", ".join(self.weight_transfer_backends) or "none"
        return f"takes weights by {takes}, not {backend}"


@dataclass(frozen=True)
class OpenWeightUpdate:
    """A weight update a server holds open (e.g. one a crashed trainer left)."""

    owner: str
    age_seconds: float
    idle_seconds: float
    lease_seconds: int
    weight_version: int  # the version it would commit
    parameters_staged: int
    bytes_received: int


@dataclass(frozen=True)
class ServerInfo:
    """One engine server: its shape, capabilities, engine and weights."""

    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    # Ranks it takes in a collective weight-transfer group (one per tensor-parallel group).
    weight_group_ranks: int
    capabilities: Capabilities
    weight_version: int
    engine: str
    engine_version: str
    server_version: str
    served_model_name: str
    device: str
    open_weight_update: OpenWeightUpdate | None
    # The version a rollback would serve again (None: nothing to roll back).
    rollback_weight_version: int | None

    @classmethod
    def from_proto(cls, info: cp.GetServerInfoResponse) -> ServerInfo:
        caps = info.capabilities
        modes = {v: k for k, v in _PAUSE_MODES.items()}
        backends = tuple(
            cp.WeightTransferBackend.Name(b).removeprefix("WEIGHT_TRANSFER_BACKEND_").lower()
            for b in caps.weight_transfer_backends
        )
        update = info.open_weight_update if info.HasField("open_weight_update") else None
        return cls(
            world_size=info.world_size,
            tensor_parallel_size=info.tensor_parallel_size,
            pipeline_parallel_size=info.pipeline_parallel_size,
            data_parallel_size=info.data_parallel_size,
            weight_group_ranks=group_ranks(info),
            capabilities=Capabilities(
                sleep=caps.sleep,
                weight_transfer_backends=backends,
                pause_modes=tuple(modes[m] for m in caps.pause_modes if m in modes),
                prefix_caching=caps.prefix_caching,
                lora=LoraCapabilities(
                    enabled=caps.lora.enabled,
                    max_loras=caps.lora.max_loras,
                    max_lora_rank=caps.lora.max_lora_rank,
                    max_cpu_loras=caps.lora.max_cpu_loras,
                ),
                protocols=tuple(caps.protocols),
                routed_experts=caps.routed_experts,
            ),
            weight_version=info.weight_version,
            engine=info.engine,
            engine_version=info.engine_version,
            server_version=info.server_version,
            served_model_name=info.served_model_name,
            device=info.device,
            open_weight_update=(
                None
                if update is None
                else OpenWeightUpdate(
                    owner=update.owner,
                    age_seconds=update.age_seconds,
                    idle_seconds=update.idle_seconds,
                    lease_seconds=update.lease_seconds,
                    weight_version=update.weight_version,
                    parameters_staged=update.parameters_staged,
                    bytes_received=update.bytes_received,
                )
            ),
            rollback_weight_version=(
                info.rollback_weight_version if info.HasField("rollback_weight_version") else None
            ),
        )


@dataclass(frozen=True)
class ServerLoad:
    """How busy one server is now."""

    running_requests: int
    waiting_requests: int
    kv_cache_usage: float  # 0..1
    paused: bool

    @classmethod
    def from_proto(cls, load: cp.GetLoadResponse) -> ServerLoad:
        return cls(load.running_requests, load.waiting_requests, load.kv_cache_usage, load.paused)


@dataclass(frozen=True)
class WeightCommit:
    """One server's answer to the commit of a weight update."""

    weight_version: int
    parameters_updated: int

    @classmethod
    def from_proto(cls, response: cp.FinishWeightUpdateResponse) -> WeightCommit:
        return cls(response.weight_version, response.parameters_updated)


class UpdatePhases(dict[str, float]):
    """Seconds each phase of a weight update took, as the trainer waited for it: ``start``
    (every server opened it), ``transfer`` (every byte sent and every server's staging
    answered: a server's own staging after the last byte is in it), ``commit`` (every server
    put the new weights in service), ``release`` (with ``release_memory``) and ``record`` (the
    pushed weights kept as the next delta's base)."""

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self[phase] = self.get(phase, 0.0) + time.monotonic() - began


class WeightUpdateResult(dict[str, WeightCommit]):
    """Each server's answer to the commit of a weight update (by address), and what the update
    moved: ``bytes_sent``, every byte this client itself sent (in-band: each stream once when
    relayed, whatever the fleet's size; over the collective: what rank 0 broadcast);
    ``bytes_received``, each server's parameter data; ``relayed``, whether the servers relayed
    the update to each other; ``phases``, where the trainer waited (``UpdatePhases``);
    ``cut_out``, the servers left out of it because they could not be reached
    (``update_weights(cut_out_unreachable=True)``), with why: they keep their previous weights
    until a later update takes them back."""

    def __init__(
        self,
        commits: Mapping[str, WeightCommit],
        *,
        bytes_sent: int,
        bytes_received: Mapping[str, int],
        relayed: bool,
        phases: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__(commits)
        self.bytes_sent = bytes_sent
        self.bytes_received = dict(bytes_received)
        self.relayed = relayed
        self.phases = UpdatePhases(phases or {})
        self.cut_out: dict[str, str] = {}


def group_ranks(info: cp.GetServerInfoResponse) -> int:
    """The ranks a server takes in a weight-transfer group (a server older than the field: all
    its workers)."""
    return info.weight_group_ranks or info.world_size


def refuse_unless_all(
    operation: str, infos: Mapping[str, ServerInfo], reason: Callable[[ServerInfo], str | None]
) -> None:
    """Raises ``Unsupported`` naming every server whose ``reason`` says it cannot take
    ``operation`` (before the caller sends it to any)."""
    refusing = {a: why for a, info in infos.items() if (why := reason(info)) is not None}
    if refusing:
        raise Unsupported(operation, refusing)
