"""The arguments vLLM's engine starts with, from a server's options: a pure function of the
options and the platform's facts, so every rule here is unit tested without starting vLLM."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servers.engine.options import EngineOptions, RequestLimits
from servers.engine.transfer.protocol import BACKEND as WEIGHT_TRANSFER_BACKEND
from servers.engine.transfer.protocol import COMMIT_PREPARE_ENVIRONMENT, HEAP_SLACK_ENVIRONMENT
from skyrl_grpc.tiny_model import embedded_model_name, embedded_model_path


@dataclass(frozen=True)
class Platform:
    """What the engine's platform is (vLLM's ``current_platform``), as plain facts."""

    is_cpu: bool
    sleep_mode_available: bool = False


@dataclass(frozen=True)
class EngineArguments:
    """``AsyncEngineArgs`` keyword arguments, and the environment the engine process must
    inherit (set before it starts)."""

    args: dict[str, Any]
    environment: dict[str, str] = field(default_factory=dict)


def engine_arguments(
    options: EngineOptions, limits: RequestLimits, platform: Platform, model_path: str
) -> EngineArguments:
    """What vLLM starts with for these options on this platform."""
    if options.weight_commit_prepare and not (platform.is_cpu and options.enforce_eager):
        raise ValueError(
            "--weight-commit-prepare: CPU engines in eager mode only (elsewhere CUDA graphs or "
            "compiled code hold the tensors a commit must write into)"
        )
    # Read by the weight-transfer engine in each worker (vLLM's config has no place for it).
    environment: dict[str, str] = {
        HEAP_SLACK_ENVIRONMENT: f"{options.weight_heap_slack:g}",
        COMMIT_PREPARE_ENVIRONMENT: "1" if options.weight_commit_prepare else "0",
    }
    dtype = options.dtype
    embedded = embedded_model_name(options.model)
    if dtype == "auto" and embedded:
        dtype = "float32"  # the embedded models are saved in float32; keep outputs exact
    args: dict[str, Any] = dict(
        model=model_path,
        served_model_name=options.served_model_name or embedded,
        dtype=dtype,
        max_model_len=options.max_model_len,
        tensor_parallel_size=options.tensor_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
        max_num_seqs=options.max_num_seqs,
        seed=options.seed,
        enable_prefix_caching=options.enable_prefix_caching,
        enforce_eager=options.enforce_eager,
        worker_extension_cls=options.worker_extension_cls,
        # New weights go through vLLM's weight-transfer lifecycle, into this project's engine
        # (servers/engine/worker/transfer_engine.py, registered by its vLLM plugin).
        weight_transfer_config={"backend": WEIGHT_TRANSFER_BACKEND},
        disable_log_stats=False,
        max_logprobs=limits.max_logprobs,
    )
    if options.enable_return_routed_experts:  # vLLM checks its runner can capture them
        args["enable_return_routed_experts"] = True
    if options.otlp_traces_endpoint:  # vLLM's own per-request span (llm_request)
        args["otlp_traces_endpoint"] = options.otlp_traces_endpoint
    if options.enable_lora:
        # On CPU one more slot: base-model requests run on a zero adapter (see
        # VllmEngine._install_base_adapter).
        extra = 1 if platform.is_cpu else 0
        args.update(
            enable_lora=True,
            max_loras=options.max_loras + extra,
            max_lora_rank=options.max_lora_rank,
            max_cpu_loras=(options.max_cpu_loras or options.max_loras) + extra,
        )
    if platform.is_cpu:
        # In bytes, so a fraction of a GiB works (vLLM reads VLLM_CPU_KVCACHE_SPACE as whole
        # GiB, and an operator who sets it still wins: vLLM's CPU platform applies it over this).
        args["kv_cache_memory_bytes"] = kv_cache_bytes(kv_cache_gib(options))
        layout_args, layout_env = cpu_layout(options)
        args.update(layout_args)
        environment.update(layout_env)
    else:
        args["gpu_memory_utilization"] = options.gpu_memory_utilization
        args["enable_sleep_mode"] = platform.sleep_mode_available
    if options.structured_outputs_config:
        args["structured_outputs_config"] = structured_outputs_config(
            options.structured_outputs_config
        )
    args.update(options.extra_engine_args)
    return EngineArguments(args, environment)


# The embedded models' KV cache (the tiny Llama's attention, which the mixture of experts
# shares): 1 KiB a token, so 131,072 tokens, their whole context (512) for each of 256
# sequences (the default max_num_seqs). 1 GiB would hold 8 times that and cost 0.9 GB more host
# memory an engine.
TINY_MODEL_KV_CACHE_GIB = 0.125


def kv_cache_gib(options: EngineOptions) -> float:
    """The CPU KV cache's size: ``--kv-cache-gib``, or the default for the model served."""
    if options.kv_cache_gib is not None:
        return options.kv_cache_gib
    return TINY_MODEL_KV_CACHE_GIB if embedded_model_name(options.model) else 1.0


def kv_cache_bytes(gib: float) -> int:
    """``--kv-cache-gib`` in bytes (a positive number of GiB; refused otherwise)."""
    if not gib > 0:
        raise ValueError(f"--kv-cache-gib {gib:g}: must be a positive number of GiB")
    return int(gib * (1 << 30))


def structured_outputs_config(settings: dict[str, Any]) -> Any:
    """vLLM's ``StructuredOutputsConfig`` of ``--structured-outputs-config``'s settings,
    refused (naming the flag) when vLLM does not take them."""
    from pydantic import ValidationError
    from vllm.config import StructuredOutputsConfig

    try:
        return StructuredOutputsConfig(**settings)
    except (TypeError, ValueError, ValidationError) as error:
        raise ValueError(f"--structured-outputs-config {json.dumps(settings)}: {error}") from None


class ModelNotFound(ValueError):
    """``--model`` names a local directory that is not there."""


class ContextTooLong(ValueError):
    """``--max-model-len`` asks for more than the model's context."""


def resolved_model(options: EngineOptions) -> str:
    """The model directory to serve (the embedded tiny model's, built on first use, by default),
    checked against the options that depend on it (``check_context``)."""
    path = _model_path(options)
    check_context(options, path)
    return path


def check_context(options: EngineOptions, model_path: str) -> None:
    """A ``--max-model-len`` over a local model's context (``max_position_embeddings`` in its
    config.json) fails here, naming the flag and the limit, instead of after seconds of vLLM's
    imports with a pydantic validation error (vLLM's own override, its environment variable
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``, is respected)."""
    config = Path(model_path) / "config.json"
    if options.max_model_len is None or not config.is_file():
        return
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0") not in ("", "0"):
        return
    limit = json.loads(config.read_text()).get("max_position_embeddings")
    if isinstance(limit, int) and options.max_model_len > limit:
        which = f"--model {options.model}" if options.model else "the embedded model"
        raise ContextTooLong(
            f"--max-model-len {options.max_model_len}: {which} has a context of {limit} tokens "
            f"(max_position_embeddings in {config}); use at most {limit}, or a model with a "
            "longer context"
        )


def _model_path(options: EngineOptions) -> str:
    """A local path that does not exist fails here, at once and by name, instead of after
    seconds of vLLM's imports with Hugging Face's complaint about repo ids. A local path is
    returned with ``~`` expanded: vLLM does not expand it, and would take ``~/model`` for a
    repo id."""
    embedded = embedded_model_path(options.model)
    if embedded is not None:
        return str(embedded)
    model = options.model or ""  # not empty: "" names the embedded tiny Llama
    if model.startswith(("/", "./", "../", "~")):
        path = Path(model).expanduser()
        if not path.is_dir():
            what = "is a file, not a model directory" if path.exists() else "does not exist"
            raise ModelNotFound(
                f"--model {model}: {what} (a local path; a Hugging Face repo id has the "
                "form org/name)"
            )
        return str(path)
    return model


def cpu_layout(options: EngineOptions) -> tuple[dict[str, Any], dict[str, str]]:
    """Engine arguments, and the environment the engine process must inherit, for CPU serving.

    With one worker, the model runs inside the engine-core process (vLLM's uni executor) rather
    than in a separate worker process: on CPU the two processes busy-wait on each other through
    a shared-memory ring, which costs a whole core on a small machine. Measured on 2 cores
    (the former stack benchmark, since folded into scripts/bench_rollout.py): about twice the
    streaming throughput. The benchmarks start vLLM's own HTTP server with the same layout.
    """
    env: dict[str, str] = {}
    threads = options.cpu_threads
    if threads is None and embedded_model_name(options.model):
        threads = 1
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if options.tensor_parallel_size * options.pipeline_parallel_size != 1:
        return {}, env
    # vLLM's CPU platform switches "uni" back to its multiprocess executor unless this is 0;
    # AsyncLLM still runs the engine core in its own process.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return {"distributed_executor_backend": "uni"}, env


def cannot_generate(cause: str) -> str:
    """What a server says when its engine started but cannot generate (the warm-up's error,
    ``cause``), with what to try: the settings, not the model, are what it can change."""
    if "triton" in cause.lower():
        # e.g. LoRA on a mixture-of-experts model: vLLM runs its experts' LoRA through Triton
        # kernels, which its CPU build does not have.
        hint = (
            "vLLM runs this combination (e.g. --enable-lora on a mixture-of-experts model) "
            "with Triton kernels, which its CPU build lacks: drop the option here, or serve on "
            "a GPU"
        )
    else:
        hint = (
            "If the engine's dtype is the problem on this machine (e.g. a CPU whose bfloat16 "
            "kernels fail), start it with --dtype float32"
        )
    said = "the engine started but cannot generate with this model and these settings"
    return f"{said}: {cause}. {hint}"
