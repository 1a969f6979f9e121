"""Waiting for real conditions instead of fixed sleeps."""

from __future__ import annotations

import asyncio
from typing import Any

from trainer_client import InferenceClient


async def running_on_engines(
    client: InferenceClient, count: int, pending: asyncio.Future[Any]
) -> None:
    """Waits until the engines run ``count`` requests (a fixed sleep races the fast tiny model)."""
    while sum(load.running_requests for load in (await client.load()).values()) < count:
        if pending.done():
            error = pending.exception()
            raise AssertionError(f"the requests ended before they were seen running: {error!r}")
        await asyncio.sleep(0.01)
