"""Answering a client-streaming call before its stream has ended."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any


async def read_rest(requests: AsyncIterator[Any], limit_seconds: float) -> None:
    """Reads what the caller still sends, for at most ``limit_seconds``, before the call is
    answered with an error: a call rejected mid-send otherwise ends with a transport error at
    the caller instead of the status that explains it."""

    async def drain() -> None:
        async for _ in requests:
            pass

    with contextlib.suppress(Exception):
        await asyncio.wait_for(drain(), limit_seconds)
