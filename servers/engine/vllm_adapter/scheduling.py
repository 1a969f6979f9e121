"""The engine's scheduling limits as vLLM configured them: what vLLM's ``Control.GetServerInfo``
reports (``service.vllm_api``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchedulingLimits:
    """How the engine schedules: KV-cache blocks (tokens each, how many) and the most requests
    and tokens one step takes. 0: not known."""

    block_size: int
    total_blocks: int
    max_num_seqs: int
    max_batched_tokens: int


def scheduling_limits(llm: Any) -> SchedulingLimits:
    """From ``AsyncLLM``'s config, once its engine core started (which sizes the KV cache)."""
    config = llm.vllm_config
    cache, scheduler = config.cache_config, config.scheduler_config
    return SchedulingLimits(
        block_size=int(cache.block_size or 0),
        total_blocks=int(cache.num_gpu_blocks or 0),
        max_num_seqs=int(scheduler.max_num_seqs or 0),
        max_batched_tokens=int(scheduler.max_num_batched_tokens or 0),
    )
