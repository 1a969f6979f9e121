"""A router replica's siblings: the other replicas sharing its ports (``replicas``), each also
reachable on a port of its own, so that what one replica is told the others are told too.

A membership change (RouterAdmin AddBackend, RemoveBackend, DrainBackend, SetStandby) reaches
one replica through the shared port; that replica applies it and passes it on to every sibling
on its own port, marked as passed on (``x-skyrl-from-replica``), so no sibling passes it on
again. A replica that starts (or is restarted) takes the membership from the first sibling that
answers, instead of the backends on its command line, which may be older than the fleet.
Sessions need nothing of this: every replica follows the servers' own reports
(``skyrl_grpc.placement``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from skyrl_grpc.channels import open_channel
from skyrl_grpc.metadata import bearer
from skyrl_grpc.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

# Marks a RouterAdmin call one replica passes on to another.
FROM_REPLICA = "x-skyrl-from-replica"
# Seconds a sibling gets to answer.
SIBLING_SECONDS = 10.0


def passed_on(metadata: Iterable[tuple[str, Any]] | None) -> bool:
    """Whether a call came from a sibling replica (and goes no further)."""
    return any(key == FROM_REPLICA for key, _ in metadata or ())


class Siblings:
    """The other replicas, at ``addresses`` (their own ports), called with the admin token."""

    def __init__(self, replica: int, addresses: Sequence[str], token: str | None) -> None:
        self.replica = replica
        self.addresses = [a for i, a in enumerate(addresses) if i != replica]
        self._metadata = ((FROM_REPLICA, str(replica)), *((bearer(token),) if token else ()))

    async def _each(self, call: str, request: Any) -> list[Any]:
        async def one(address: str) -> Any:
            async with open_channel(address) as channel:
                stub = router_pb2_grpc.RouterAdminStub(channel)
                method = getattr(stub, call)
                return await method(request, metadata=self._metadata, timeout=SIBLING_SECONDS)

        answers = await asyncio.gather(*(one(a) for a in self.addresses), return_exceptions=True)
        for address, answer in zip(self.addresses, answers, strict=True):
            if isinstance(answer, grpc.aio.AioRpcError):
                # A sibling that is down learns the membership when it is back (``membership``).
                log.warning("router replica at %s was not told %s: %s", address, call, answer)
        return list(answers)

    async def tell(self, call: str, request: Any) -> None:
        """Passes a membership change on to every sibling."""
        await self._each(call, request)

    async def promotion(self, promoted: str, lost: str) -> None:
        """Passes on a standby's promotion in a lost server's place (``BackendPool``)."""
        for address, standby in ((promoted, False), (lost, True)):
            await self.tell(
                "SetStandby", router_pb2.SetStandbyRequest(address=address, standby=standby)
            )

    async def membership(self) -> list[tuple[str, bool]] | None:
        """The backends the first sibling that answers routes to, as (address, standby)
        (None: none answered)."""
        for answer in await self._each("ListBackends", router_pb2.ListBackendsRequest()):
            if isinstance(answer, router_pb2.ListBackendsResponse):
                return [(backend.address, backend.standby) for backend in answer.backends]
        return None
