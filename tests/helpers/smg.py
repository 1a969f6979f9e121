"""SMG, the Rust gateway, over engine servers' vLLM protocol for a test: the gateway ``up
--gateway smg`` launches (``servers.fleet.gateway.SmgGateway``: sessions kept by
``x-session-id``), started and stopped off the test's event loop, whose in-process engine
servers keep serving meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from servers.fleet.gateway import SmgGateway
from skyrl_grpc.process_group import free_port


@contextlib.asynccontextmanager
async def smg_over(servers: Sequence[str], *flags: str) -> AsyncIterator[SmgGateway]:
    """SMG over the engine servers at ``servers`` (host:port each), ``flags`` added to its
    command line, once it lists the model and every server."""
    gateway = SmgGateway("127.0.0.1", free_port("127.0.0.1"), on_event=lambda _: None,
                         extra_args=flags)  # fmt: skip
    try:
        await asyncio.to_thread(gateway.start, servers)
        yield gateway
    finally:
        await asyncio.to_thread(gateway.close)
