"""The scheduler's latest figures (running, waiting, KV use), kept by a vLLM stat logger."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Load:
    running: int
    waiting: int
    kv_cache_usage: float


class LoadTracker:
    """A vLLM stat logger (``factory``) that keeps the latest scheduler figures."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0

    def factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        tracker = self

        class Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any
            ) -> None:
                if scheduler_stats is not None:
                    tracker.running = scheduler_stats.num_running_reqs
                    tracker.waiting = scheduler_stats.num_waiting_reqs
                    tracker.kv_cache_usage = scheduler_stats.kv_cache_usage

            def log_engine_initialized(self) -> None:
                pass

        return Logger

    def load(self, unfinished: int) -> Load:
        """The load now, given vLLM's count of unfinished requests (the scheduler's figures
        only refresh on engine steps: an idle engine reports none running)."""
        if unfinished == 0:
            return Load(0, 0, self.kv_cache_usage)
        running = min(self.running, unfinished)
        return Load(running, max(unfinished - running, 0), self.kv_cache_usage)
