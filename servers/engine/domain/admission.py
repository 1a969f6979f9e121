"""How much generation a server takes at once, and how much it lets wait.

Every generation request asks for ``n`` samples. ``Admission`` lets samples run up to a limit
(``--max-concurrent-samples``); requests beyond it wait in arrival order, up to a queue bound
(``--max-queued-requests``); beyond that, a request is refused at once with RESOURCE_EXHAUSTED
instead of growing a queue whose tail no caller would wait for. Plain asyncio, no engine: its
rules are tested directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from skyrl_grpc.errors import ResourceExhausted


class Admission:
    """A fair (first come, first served) weighted semaphore with a bounded queue."""

    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.running = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def capacity(self) -> int:
        """The most requests it holds at once, running and waiting (each running one has at
        least one sample)."""
        return self.max_running + self.max_queued

    @asynccontextmanager
    async def admit(self, weight: int) -> AsyncIterator[None]:
        """Holds ``weight`` running slots for the duration of the block (a request asking for
        more than the limit runs alone)."""
        held = await self.acquire(weight)
        try:
            yield
        finally:
            self.release(held)

    async def acquire(self, weight: int) -> int:
        """Waits for ``weight`` running slots (its turn, in arrival order) and takes them;
        returns what to ``release`` once the request ends."""
        weight = min(weight, self.max_running)
        if not self._waiting and self.running + weight <= self.max_running:
            self.running += weight
            return weight
        if len(self._waiting) >= self.max_queued:
            raise ResourceExhausted(
                f"this server runs {self.running} samples (limit {self.max_running}, "
                f"--max-concurrent-samples) and {len(self._waiting)} requests wait for a "
                f"turn (limit {self.max_queued}, --max-queued-requests): retry later, or "
                "send to another server"
            )
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (weight, turn)
        self._waiting.append(entry)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.release(weight)  # admitted just as the caller gave up
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(entry)
                self._wake()
            raise
        return weight

    def release(self, weight: int) -> None:
        """Gives back what ``acquire`` returned."""
        self.running -= weight
        self._wake()

    def _wake(self) -> None:
        """Admits waiting requests in order while they fit."""
        while self._waiting:
            weight, turn = self._waiting[0]
            if turn.done():  # its caller gave up
                self._waiting.popleft()
                continue
            if self.running + weight > self.max_running:
                return
            self._waiting.popleft()
            self.running += weight
            turn.set_result(None)
