"""vLLM's ``AsyncLLM`` for code written against it to run beside it: vLLM's own gRPC servicer
(``VllmEngineServicer``, smg-grpc-servicer's, what ``vllm serve --grpc`` runs) takes an
``EngineClient`` and expects to run on the loop ``AsyncLLM`` runs on. Here that is the engine's
own loop and thread (``engine_loop``), so such code runs there, as in vLLM's own server: its
coroutines through ``call``, its streams through ``stream`` (what they yield handed to the
caller's loop in batches; cancelling the caller cancels them, which aborts their requests).
Converting each step's outputs to messages then happens beside vLLM's output processing, not
on the gRPC loop, as for the DataPlane (``service.stream_steps``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from servers.engine.vllm_adapter.engine_loop import EngineLoop

T = TypeVar("T")


class EngineClientView:
    """``AsyncLLM`` (``llm``, vLLM's ``EngineClient``) and the loop that code using it runs on."""

    def __init__(self, llm: Any, engine_loop: EngineLoop) -> None:
        self.llm = llm
        self._engine_loop = engine_loop

    async def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs ``coroutine`` on the engine's loop."""
        return await self._engine_loop.call(coroutine)

    def stream(self, iterator: Callable[[], AsyncIterator[T]]) -> AsyncIterator[T]:
        """Iterates ``iterator()`` on the engine's loop, yielding its items here."""
        return self._engine_loop.stream(iterator, _one)


def _one(item: T) -> tuple[T]:
    return (item,)
