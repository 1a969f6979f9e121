"""vLLM's ``AsyncLLM`` as code written for it calls it from the gRPC loop: vLLM's own gRPC
servicer (``VllmEngineServicer``, smg-grpc-servicer's, what ``vllm serve --grpc`` runs) takes an
``EngineClient`` and awaits its coroutines and iterates its ``generate`` on the loop it runs on.
Here ``AsyncLLM`` lives on its own loop and thread (``engine_loop``), so this view runs each of
its coroutines there (``EngineLoop.call``) and relays ``generate``'s outputs from there
(``EngineLoop.stream``: cancelling the consumer aborts the request, as vLLM's own server does);
everything else the servicer reads (``model_config``, ``vllm_config``, the renderer, the stat
loggers' last snapshot, ``errored``) is read from ``AsyncLLM`` directly.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

from servers.engine.vllm_adapter.engine_loop import EngineLoop


class EngineClientView:
    """``AsyncLLM`` with its coroutines run on the engine's loop, for servicers on another."""

    def __init__(self, llm: Any, engine_loop: EngineLoop) -> None:
        self._llm = llm
        self._engine_loop = engine_loop

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """``AsyncLLM.generate`` iterated on the engine's loop, its outputs yielded here."""
        return self._engine_loop.stream(lambda: self._llm.generate(*args, **kwargs), _one)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._llm, name)
        if inspect.iscoroutinefunction(value):
            return self._on_engine_loop(value)
        return value

    def _on_engine_loop(self, method: Callable[..., Any]) -> Callable[..., Any]:
        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._engine_loop.call(method(*args, **kwargs))

        return call


def _one(output: Any) -> tuple[Any]:
    return (output,)
