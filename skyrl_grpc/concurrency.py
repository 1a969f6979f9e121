"""Running the parts of one request concurrently, as one: all succeed, or none keeps running.

``asyncio.gather`` leaves the other parts running when one fails: a batch whose first prompt
is refused would keep generating every other sample on the fleet, for a caller that has
already seen the error. ``all_or_cancel`` cancels the siblings of the first failure (a
cancelled generation aborts its request on the server) and waits until they have ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def all_or_cancel(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Runs every awaitable concurrently and returns their results in order.

    The first failure cancels the others, waits for them to end and is raised; cancelling the
    caller cancels them all the same way.
    """
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        await _cancel_and_wait(tasks)
        raise
    if pending:
        await _cancel_and_wait(pending)
        # The first failures, in the order given (several may have failed in one step).
        for task in tasks:
            error = task.exception() if task in done and not task.cancelled() else None
            if error is not None:
                raise error
    return [task.result() for task in tasks]


async def _cancel_and_wait(tasks: Iterable[asyncio.Future[T]]) -> None:
    listed = list(tasks)
    for task in listed:
        task.cancel()
    await asyncio.gather(*listed, return_exceptions=True)
