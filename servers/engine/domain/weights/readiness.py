"""When a server allocates the staging memory its first full weight update writes into
(``--weight-staging``).

It is the model's bytes again, held from then on, and what the first update would otherwise
fault in inside a trainer's step. Allocated at start, an idle server holds it forever;
allocated beside its first generation, a server that never serves (a warm standby, a fleet
waiting for its trainer) holds only vLLM's own and the checkpoint copy, and a trainer's first
rollout gives the allocation its time, as the update that follows needs. The allocation
touches no model state (it is safe beside generations); the one reload of every layer, which
does, stays at start, before the server serves (``ServingWeights.reload_at_start``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from servers.engine.options import STAGING_AT_FIRST_GENERATION as AT_FIRST_GENERATION
from servers.engine.options import STAGING_AT_START as AT_START
from servers.engine.options import STAGING_CHOICES as CHOICES

log = logging.getLogger(__name__)


class UpdateReadiness:
    """Runs ``prepare`` at most once: at the moment ``when`` names (at start; beside the first
    generation, or before the first update when it comes first; or never, the first update
    paying what it prepares). ``prepare`` may fail (a
    model whose weights cannot be reloaded): at start that fails the start; later it is
    logged, and the update meets the same failure itself."""

    def __init__(self, prepare: Callable[[], Awaitable[None]], when: str) -> None:
        if when not in CHOICES:
            raise ValueError(f"--weight-staging {when!r}: one of {', '.join(CHOICES)}")
        self._prepare = prepare
        self.when = when
        self._task: asyncio.Task[None] | None = None

    @property
    def prepared(self) -> bool:
        """Whether the preparation ran to its end (successfully or not)."""
        return self._task is not None and self._task.done()

    async def at_start(self) -> None:
        """Prepares now when ``when`` is start (raising what ``prepare`` raises)."""
        if self.when == AT_START and self._task is None:
            self._task = asyncio.ensure_future(self._prepare())
            await self._task

    def on_generation(self) -> None:
        """A generation begins: the preparation starts beside it, once."""
        if self.when == AT_FIRST_GENERATION and self._task is None:
            self._task = asyncio.ensure_future(self._logged())

    async def before_update(self) -> None:
        """An update opens: the preparation finished first (never beside an open update)."""
        self.on_generation()  # started now, where no generation started it yet
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _logged(self) -> None:
        try:
            await self._prepare()
        except Exception:
            log.warning("preparing for weight updates failed", exc_info=True)
