"""A call on the router's forwarding path made for a caller in this process: a request of the
HTTP edge, a request of a caller's GenerateMultiplex call (``multiplex_relay``).

``Proxy`` reads a gRPC call's context: its metadata, its deadline, the headers it sends and the
status it ends with. ``InnerCall`` is what it reads for a call that has no context of its own:
the metadata it is given, the deadline of the call it is made for (none for HTTP: a client's
disconnect cancels instead), headers dropped (its caller's own call sends its own), and its
status raised (``CallFailed``) for its caller to report as that caller reports errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, cast

import grpc

from servers.common.grpc_types import Context
from servers.router.upstreams import Metadata


class CallFailed(Exception):
    """A call on the forwarding path ended with a gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def _no_deadline() -> float | None:
    return None


class InnerCall:
    """What ``Proxy`` reads of a gRPC call's context, for a call made in this process."""

    def __init__(
        self, metadata: Metadata, time_remaining: Callable[[], float | None] = _no_deadline
    ) -> None:
        self._metadata = metadata
        self.time_remaining = time_remaining

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    async def send_initial_metadata(self, _: Any) -> None:
        return None

    async def abort(self, code: grpc.StatusCode, details: str = "", _: Any = ()) -> NoReturn:
        raise CallFailed(code, details)

    def context(self) -> Context:
        """This call as the proxy's functions take a context."""
        return cast(Context, self)
