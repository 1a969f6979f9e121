"""Answering a client-streaming call before its stream has ended."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

# How long a call answered early keeps reading what its caller still sends: one value for
# every client-streaming call (weights, LoRA uploads, forwarded streams), long enough for the
# rest of a rejected weight push already in flight on a fast link, short enough that a caller
# who never stops cannot hold the call.
READ_REST_SECONDS = 10.0


async def read_rest(requests: AsyncIterator[Any], limit_seconds: float = READ_REST_SECONDS) -> None:
    """Reads what the caller still sends, for at most ``limit_seconds``, before the call is
    answered with an error: a call rejected mid-send otherwise ends with a transport error at
    the caller instead of the status that explains it."""

    async def drain() -> None:
        async for _ in requests:
            pass

    with contextlib.suppress(Exception):
        await asyncio.wait_for(drain(), limit_seconds)
