"""Which handler serves each DataPlane method on the router: the proxy's forwarding path
(``proxy``), its fan-outs (Abort, FinishSession everywhere), batches (``batch_relay``) and
multiplexed calls (``multiplex_relay``)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import grpc

from servers.common.grpc_types import Handler
from servers.router.batch_relay import relay_batch
from servers.router.multiplex_relay import relay_multiplex
from servers.router.proxy import Proxy
from skyrl_grpc.names import (
    ABORT,
    DATA_PLANE,
    DATA_PLANE_SERVICE,
    FINISH_SESSION,
    GENERATE_BATCH,
    GENERATE_MULTIPLEX,
)


class ForwardingHandler(grpc.GenericRpcHandler):
    """Routes every method of the proxied services to the Proxy, as raw bytes."""

    def __init__(self, proxy: Proxy, services: Sequence[str] = (DATA_PLANE,)) -> None:
        self._proxy = proxy
        self._prefixes = tuple(f"/{s}/" for s in services)
        # Known methods keep their real shape (cheaper than a bidi stream); unknown methods of
        # a proxied service (a newer contract than this router) are relayed as bidi streams.
        self._streaming = {
            f"/{DATA_PLANE}/{m.name}": (m.client_streaming, m.server_streaming)
            for m in DATA_PLANE_SERVICE.methods
        }

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        method: str = handler_call_details.method
        if not method.startswith(self._prefixes):
            return None
        if method == ABORT:
            return grpc.unary_unary_rpc_method_handler(self._proxy.abort_everywhere)
        if method == FINISH_SESSION:
            return grpc.unary_unary_rpc_method_handler(self._proxy.finish_session_everywhere)
        if method == GENERATE_BATCH:
            return grpc.unary_stream_rpc_method_handler(partial(relay_batch, self._proxy))
        if method == GENERATE_MULTIPLEX:
            return grpc.stream_stream_rpc_method_handler(partial(relay_multiplex, self._proxy))
        shape = self._streaming.get(method, (True, True))
        # partial keeps the coroutine / async-generator nature grpc inspects to drive the call.
        if shape == (False, False):
            return grpc.unary_unary_rpc_method_handler(partial(self._proxy.unary_unary, method))
        if shape == (False, True):
            return grpc.unary_stream_rpc_method_handler(partial(self._proxy.unary_stream, method))
        return grpc.stream_stream_rpc_method_handler(partial(self._proxy.stream_stream, method))
