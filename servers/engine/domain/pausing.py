"""Pausing generation on a server (vLLM's modes: abort, wait, keep) and resuming it, each
change announced to the placers that watch the server's status."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from servers.engine.vllm_adapter.vllm_engine import PauseModeName


class Pausing:
    """Pause and resume over the engine's own calls; ``announce`` after each change."""

    def __init__(
        self,
        pause: Callable[[PauseModeName, bool], Awaitable[None]],
        resume: Callable[[], Awaitable[None]],
        is_paused: Callable[[], Awaitable[bool]],
        announce: Callable[[], None],
    ) -> None:
        self._pause = pause
        self._resume = resume
        self.is_paused = is_paused
        self._announce = announce

    async def pause(self, mode: PauseModeName, clear_cache: bool) -> None:
        await self._pause(mode, clear_cache)
        self._announce()

    async def resume(self) -> None:
        await self._resume()
        self._announce()
