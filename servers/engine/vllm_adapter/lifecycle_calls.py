"""vLLM's weight-transfer lifecycle as ``AsyncLLM`` offers it (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``), typed for
``protocol.WorkerCalls``; the engine adapter (``vllm_engine``) hands it its call runner."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


class AsyncLLMLifecycle:
    """vLLM's weight-transfer lifecycle on ``AsyncLLM`` (``transfer.protocol.Lifecycle``), each
    call run by ``run`` (``VllmEngine``'s runner: on the engine loop, the engine's death named)."""

    def __init__(self, llm: Any, run: Callable[[Coroutine[Any, Any, Any]], Awaitable[Any]]):
        self._llm = llm
        self._run = run

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._run(self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info)))

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._run(self._llm.shutdown_weight_transfer_engine())

    async def start_weight_update(self) -> None:
        await self._run(self._llm.start_weight_update())

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._run(self._llm.update_weights(WeightTransferUpdateRequest(update_info)))

    async def finish_weight_update(self, weight_version: str | None) -> None:
        await self._run(self._llm.finish_weight_update(weight_version))
