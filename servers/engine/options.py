"""How to run an engine server: its options and command-line flags.

Light on purpose (no vLLM, no torch): ``skyrl-grpc --help`` and launchers read these without
paying for the engine's imports.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from servers.common.event_loops import UVLOOP, add_event_loop_argument
from servers.common.flag_types import json_object
from servers.common.listener import (
    ServerTls,
    add_message_size_argument,
    add_tls_arguments,
    tls_from_args,
)
from servers.engine.request_limits import RequestLimits as RequestLimits
from servers.engine.request_limits import add_limit_arguments, limits_from_args
from skyrl_grpc.channels import DEFAULT_MAX_MESSAGE_BYTES, MiB
from skyrl_grpc.placement.session_directory import SESSION_IDLE_SECONDS
from skyrl_grpc.tiny_model import TINY_MODEL_NAME as TINY_MODEL_NAME
from skyrl_grpc.tls import TlsConfig

# --weight-staging: when a server prepares for its first weight update (see EngineOptions).
STAGING_AT_FIRST_GENERATION = "first-generation"
STAGING_AT_START = "start"
STAGING_AT_FIRST_UPDATE = "first-update"
STAGING_CHOICES = (STAGING_AT_FIRST_GENERATION, STAGING_AT_START, STAGING_AT_FIRST_UPDATE)

WORKER_EXTENSION = "servers.engine.worker.worker_extension.WeightTransferWorker"
DEFAULT_PORT = 50051  # the command line's; ServerOptions(port=0) picks a free port


@dataclass
class EngineOptions:
    """How to start the engine. ``model=None`` means the embedded tiny model."""

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # CPU only: GiB of host memory for the KV cache (vLLM's kv_cache_memory_bytes; a fraction
    # of a GiB works). None: TINY_MODEL_KV_CACHE_GIB for the embedded tiny model, 1 GiB for any
    # other: small, so several engines share one machine.
    kv_cache_gib: float | None = None
    # CPU only: threads the model runs on. None: 1 for the embedded tiny model (its matrices are
    # too small to gain from threads, and idle OpenMP threads spin on the cores the serving
    # layer needs), vLLM's own per-core binding for any other model.
    cpu_threads: int | None = None
    # GPU only: fraction of device memory the engine may take.
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    seed: int = 0
    enable_prefix_caching: bool = True
    # CUDA graphs / torch.compile cost start-up time and give nothing on CPU.
    enforce_eager: bool = True
    # CPU, one worker: the engine core forks from a process that imported vLLM beside this one,
    # instead of importing it again after it (about 10 s of a 25 s start; core_preload.py).
    preload_engine_core: bool = True
    # vLLM worker extension that receives weights (see servers/engine/worker/worker_extension.py).
    worker_extension_cls: str = WORKER_EXTENSION
    # Seconds an open weight update lives without a call before it expires (a trainer that
    # died must not lock the next one out); StartWeightUpdate may ask for another lease.
    weight_update_lease_seconds: float = 600.0
    # In-band weight bytes handed to vLLM's workers per call: what the server and the engine
    # core hold of a push at a time.
    weight_stage_batch_bytes: int = 32 << 20
    # A weight worker gives freed heap back once grown past its start by this many times the
    # weight bytes it holds (``servers/engine/worker/heap.py``); 0: after every update;
    # negative: never.
    weight_heap_slack: float = 1.0
    # Reload each decoder layer of an update as soon as all its tensors arrived, set aside,
    # and swap them in at the commit (``servers/engine/worker/prepared_layers.py``: CPU
    # engines in eager mode); False: the commit reloads them (one copy of the updated layers
    # less until the commit, and no reload competing with the transfer for the cores).
    weight_commit_prepare: bool = False
    # When the server prepares for its first weight update (``domain.weights.readiness``):
    # the memory a full update stages into (1x the model at TP rank 0) allocated beside the
    # first generation ("first-generation": a server that never serves holds none; every layer
    # reloaded once at start, what vLLM's first reload pays, then the heap it freed given
    # back), or with the reload at start ("start"), or neither ahead ("first-update": the first
    # update pays both; for a model whose reload fails).
    weight_staging: str = STAGING_AT_FIRST_GENERATION
    # Accept weights holding NaN or infinity (refused by default: they poison generation).
    allow_non_finite_weights: bool = False
    # A session without a request for this long ends (its place is free for placement).
    session_idle_seconds: float = SESSION_IDLE_SECONDS
    # LoRA adapters: served at all, how many in one batch, largest rank, how many loaded.
    enable_lora: bool = False
    max_loras: int = 2
    max_lora_rank: int = 8
    max_cpu_loras: int | None = None  # None: max_loras
    # Chat outputs parsed into tool calls and reasoning by vLLM's parsers of these names
    # (vLLM's --tool-call-parser / --reasoning-parser); "auto" tool choice needs the flag too.
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    enable_auto_tool_choice: bool = False
    # OpenTelemetry traces (vLLM's flag): this server's spans and vLLM's own llm_request span
    # per request go over OTLP/gRPC to this endpoint. None: no tracing, at no cost.
    otlp_traces_endpoint: str | None = None
    # vLLM's structured-outputs settings (``--structured-outputs-config``, vLLM's flag, its
    # ``StructuredOutputsConfig`` fields), e.g. ``{"disable_any_whitespace": true}``: JSON
    # outputs (forced tool calls among them) without the whitespace a grammar otherwise allows.
    structured_outputs_config: dict[str, Any] = field(default_factory=dict)
    # vLLM captures the experts each MoE layer routes every token to (its flag), which requests
    # may then ask for (SamplingParams.return_routed_experts); vLLM refuses where it cannot.
    enable_return_routed_experts: bool = False
    # The loop the server's gRPC calls and vLLM's engine client each run on (one apiece):
    # uvloop, as in vLLM's own servers, or asyncio's (servers/common/event_loops.py).
    event_loop: str = UVLOOP
    extra_engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerOptions:
    """How to run one engine server."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (see EngineServer.port)
    # The push socket's TCP port (PushSocketHello in control_plane.proto: in-band weights
    # without gRPC's cost), on ``host``: 0 any free one, -1 none. None is offered with TLS.
    weight_push_port: int = 0
    engine: EngineOptions = field(default_factory=EngineOptions)
    drain_grace_seconds: float = 10.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Bearer tokens: when set, the service answers UNAUTHENTICATED without it.
    control_token: str | None = None
    data_token: str | None = None
    tls: ServerTls | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Keep freed host memory for reuse (skyrl_grpc.host_memory): weight updates then stop
    # page-faulting through fresh memory, at the price of resident memory staying at its peak.
    keep_freed_memory: bool = True
    # Peers (host:port) to read the fleet's current weights from before serving (``catch_up``):
    # what a supervisor passes a restarted or added server.
    catch_up_from: list[str] = field(default_factory=list)
    # TLS of the channels to those peers (None: plain), as the router's to its backends.
    peer_tls: TlsConfig | None = None
    # Prometheus /metrics (vLLM's own metrics and this server's) on ``host``: 0 any free
    # port, None none.
    metrics_port: int | None = None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that starts engines. Every default comes from
    ``EngineOptions``: one place decides each of them."""
    d = EngineOptions()
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=d.model, help="model directory or id; 'tiny-moe': embedded MoE"
    )
    group.add_argument("--served-model-name", default=d.served_model_name)
    group.add_argument("--dtype", default=d.dtype)
    group.add_argument("--max-model-len", type=int, default=d.max_model_len)
    group.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size)
    group.add_argument("--pipeline-parallel-size", type=int, default=d.pipeline_parallel_size)
    group.add_argument(
        "--kv-cache-gib",
        type=float,
        default=d.kv_cache_gib,
        help="CPU: KV cache size in GiB (default: 1; 0.125 for the embedded tiny model)",
    )
    group.add_argument(
        "--cpu-threads",
        type=int,
        default=d.cpu_threads,
        help="CPU: model threads (default: 1 for the embedded tiny model, else vLLM's binding)",
    )
    group.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    group.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    group.add_argument(
        "--otlp-traces-endpoint",
        default=d.otlp_traces_endpoint,
        help="send OpenTelemetry traces over OTLP/gRPC here (host:port): a span per call, "
        "vLLM's own per request (queue, prefill, decode), each weight update phase, the "
        "catch-up; default: none",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="vLLM's sampling seed, for requests without one of their own (default %(default)s); "
        "a fleet (`up`, Ray) gives its server i this seed + i, so no two draw alike",
    )
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument(
        "--no-preload-engine-core",
        action="store_true",
        help="CPU: start vLLM's engine core with vLLM's own spawn (it imports vLLM again)",
    )
    group.add_argument(
        "--weight-update-lease-seconds",
        type=float,
        default=d.weight_update_lease_seconds,
        help="an open weight update without a call for this long expires (default %(default)s)",
    )
    group.add_argument(
        "--weight-stage-batch-bytes",
        type=int,
        default=d.weight_stage_batch_bytes,
        help="in-band weight bytes handed to the engine's workers per call: what the server "
        "holds of a push at a time (default %(default)s)",
    )
    group.add_argument(
        "--weight-heap-slack",
        type=float,
        default=d.weight_heap_slack,
        help="a weight-updating worker gives freed memory back to the system once it has grown "
        "past its start by this many times the weight bytes it holds (its shard of the model "
        "and, at rank 0, the checkpoint copy); 0: after every update (slower updates), "
        "negative: never (default %(default)s)",
    )
    group.add_argument(
        "--weight-commit-prepare",
        action="store_true",
        help="reload each updated layer as soon as its tensors arrived and swap them in at "
        "the commit (a commit of milliseconds; costs one more copy of the updated layers until "
        "then, and cores the transfer may need: for servers with cores of their own behind a "
        "slower link); CPU engines in eager mode only",
    )
    group.add_argument(
        "--weight-staging",
        choices=STAGING_CHOICES,
        default=d.weight_staging,
        help="when the server prepares for its first weight update: first-generation "
        "reloads every layer once at start and allocates the 1x model of host memory a full "
        "update stages into beside its first generation (an idle server or a standby holds "
        "none); start does both at start; first-update leaves both to the first update, "
        "which then takes longer (and serves a model whose reload fails) (default "
        "%(default)s)",
    )
    group.add_argument(
        "--session-idle-seconds",
        type=float,
        default=d.session_idle_seconds,
        help="a session without a request for this long ends (default %(default)s)",
    )
    group.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (LoadLoraAdapter)"
    )
    group.add_argument(
        "--max-loras", type=int, default=d.max_loras, help="LoRA adapters usable in one batch"
    )
    group.add_argument(
        "--max-lora-rank", type=int, default=d.max_lora_rank, help="largest LoRA rank accepted"
    )
    group.add_argument(
        "--max-cpu-loras",
        type=int,
        default=d.max_cpu_loras,
        help="LoRA adapters kept loaded (default: --max-loras)",
    )
    group.add_argument(
        "--allow-non-finite-weights",
        action="store_true",
        help="accept pushed weights holding NaN or infinity (refused by default)",
    )
    group.add_argument(
        "--tool-call-parser",
        default=d.tool_call_parser,
        help="vLLM tool-call parser for chat outputs (e.g. hermes): calls in the model's own "
        "format; needed for tool_choice auto (required and a named function need none)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs '
        "--tool-call-parser",
    )
    group.add_argument(
        "--structured-outputs-config",
        type=json_object,
        default={},
        help="vLLM's structured-outputs settings as JSON, e.g. "
        "'{\"disable_any_whitespace\": true}' (JSON outputs and forced tool calls without the "
        "free whitespace a JSON grammar allows: docs/serving.md)",
    )
    group.add_argument(
        "--reasoning-parser",
        default=d.reasoning_parser,
        help="vLLM reasoning parser: the model's reasoning returned apart from its answer",
    )
    group.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="vLLM's flag: capture the experts each MoE layer routes every token to, for "
        "requests that ask (return_routed_experts); vLLM's CPU build cannot",
    )
    add_event_loop_argument(group, d.event_loop, "the server's gRPC and vLLM's engine client")


def engine_options_from_args(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        kv_cache_gib=args.kv_cache_gib,
        cpu_threads=args.cpu_threads,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        enable_prefix_caching=not args.no_prefix_caching,
        preload_engine_core=not args.no_preload_engine_core,
        weight_update_lease_seconds=args.weight_update_lease_seconds,
        weight_stage_batch_bytes=args.weight_stage_batch_bytes,
        weight_heap_slack=args.weight_heap_slack,
        weight_commit_prepare=args.weight_commit_prepare,
        weight_staging=args.weight_staging,
        allow_non_finite_weights=args.allow_non_finite_weights,
        session_idle_seconds=args.session_idle_seconds,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        structured_outputs_config=args.structured_outputs_config,
        enable_return_routed_experts=args.enable_return_routed_experts,
        event_loop=args.event_loop,
    )


def build_parser() -> argparse.ArgumentParser:
    defaults = ServerOptions()
    parser = argparse.ArgumentParser(
        prog="skyrl-grpc serve", description="Serve one vLLM engine over gRPC."
    )
    parser.add_argument("--host", default=defaults.host)
    # The command line's well-known port; in code, ServerOptions' 0 picks a free one.
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument(
        "--weight-push-port",
        type=int,
        default=defaults.weight_push_port,
        help="TCP port of the push socket, which takes in-band weight updates without gRPC's "
        "cost (unencrypted: not offered with TLS): 0 any free port (default), -1 none",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=defaults.metrics_port,
        help="serve Prometheus /metrics on this port (vLLM's own vllm:* metrics, the weight "
        "version, weight update phases, gRPC calls; 0 picks a free one); default: none",
    )
    parser.add_argument("--drain-grace-seconds", type=float, default=defaults.drain_grace_seconds)
    add_message_size_argument(parser)
    parser.add_argument(
        "--return-freed-memory",
        action="store_true",
        help="let the C library unmap freed buffers (lower resident memory, slower weight "
        "updates; by default freed memory is kept for reuse)",
    )
    parser.add_argument(
        "--catch-up-from",
        default="",
        help="comma-separated peers (host:port): before serving, read the newest weights they "
        "serve (a restarted or added server catches up with its fleet without the trainer)",
    )
    parser.add_argument("--peer-tls-ca", default=None, help="PEM CA to verify TLS peers")
    parser.add_argument("--peer-tls-cert", default=None, help="client certificate for mTLS peers")
    parser.add_argument("--peer-tls-key", default=None, help="its private key")
    parser.add_argument(
        "--control-token",
        default=os.environ.get("SKYRL_CONTROL_TOKEN"),
        help="require this bearer token on ControlPlane (default: $SKYRL_CONTROL_TOKEN)",
    )
    parser.add_argument(
        "--data-token",
        default=os.environ.get("SKYRL_DATA_TOKEN"),
        help="require this bearer token on DataPlane (default: $SKYRL_DATA_TOKEN)",
    )
    add_limit_arguments(parser)
    add_tls_arguments(parser)
    add_engine_arguments(parser)
    return parser


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        host=args.host,
        port=args.port,
        weight_push_port=args.weight_push_port,
        metrics_port=args.metrics_port,
        engine=engine_options_from_args(args),
        drain_grace_seconds=args.drain_grace_seconds,
        max_message_bytes=args.max_message_mib * MiB,
        control_token=args.control_token,
        data_token=args.data_token,
        tls=tls_from_args(args),
        limits=limits_from_args(args),
        keep_freed_memory=not args.return_freed_memory,
        catch_up_from=[peer for peer in args.catch_up_from.split(",") if peer],
        peer_tls=(
            TlsConfig(args.peer_tls_ca, args.peer_tls_cert, args.peer_tls_key)
            if args.peer_tls_ca or args.peer_tls_cert
            else None
        ),
    )
