"""The routing proxy: one address in front of many engine servers.

``RouterServer`` serves DataPlane (every call forwarded to one backend by ``proxy``; the choice
is ``BackendPool.choose`` in ``backends``), RouterAdmin (membership at runtime, ``admin``),
grpc.health.v1 (SERVING iff a backend is healthy), reflection, and Prometheus metrics over HTTP
(``metrics``).

Run: ``skyrl-grpc route --backends host:port,host:port`` or ``python -m servers.router``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from functools import partial

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from servers.common.event_loops import new_event_loop
from servers.common.interceptors import BearerTokenInterceptor, ErrorMappingInterceptor
from servers.common.listener import (
    bind,
    server_options,
)
from servers.common.process import configure_logging, serve_until_stopped
from servers.common.reaper import exit_with_supervisor
from servers.common.tasks import BackgroundTasks
from servers.router.admin import RouterAdminServicer
from servers.router.backends import Backend, BackendPool
from servers.router.forwarding import ForwardingHandler
from servers.router.http_edge.asgi import HttpEdgeServer
from servers.router.http_edge.handlers import OpenAIEdge
from servers.router.http_edge.local_tokenizer import LocalTokenizer
from servers.router.metrics import RouterMetrics
from servers.router.options import RouterOptions, build_parser, options_from_args
from servers.router.proxy import Proxy
from servers.router.siblings import Siblings
from skyrl_grpc import tracing
from skyrl_grpc.channels import liveness_options, open_channel, prompt_reconnect_options
from skyrl_grpc.names import DATA_PLANE, ROUTER_ADMIN, WATCH_BACKENDS
from skyrl_grpc.v1 import router_pb2_grpc

log = logging.getLogger(__name__)
# What the command line and the fleets build a router from, re-exported where it is started.
__all__ = ["RouterOptions", "RouterServer", "build_parser", "main", "options_from_args", "serve"]


class RouterServer:
    """Builds and runs the router; ``start()`` returns once the port is open."""

    def __init__(self, options: RouterOptions) -> None:
        self.options = options
        self.metrics = RouterMetrics(options.replica)
        self.health = health.aio.HealthServicer()
        self.pool = BackendPool(
            options.backends,
            standbys=options.standbys,
            channel_factory=partial(
                open_channel,
                tls=options.backend_tls,
                max_message_bytes=options.max_message_bytes,
                extra_options=[
                    *liveness_options(options.backend_liveness_seconds),
                    *prompt_reconnect_options(options.backend_liveness_seconds),
                ],
            ),
            check_interval=options.health_check_interval,
            balancing=options.balancing,
            placement=options.placement,
            on_change=self._backend_changed,
        )
        self.proxy = Proxy(self.pool, self.metrics, options.proxy)
        self.server = grpc.aio.server(
            # Only admin calls raise domain errors; forwarded calls skip the interceptor.
            interceptors=[
                BearerTokenInterceptor(
                    {ROUTER_ADMIN: options.admin_token or ""}, open_methods=[WATCH_BACKENDS]
                ),
                ErrorMappingInterceptor(services=[ROUTER_ADMIN]),
            ],
            options=server_options(
                options.max_message_bytes, reuse_port=options.replica is not None
            ),
        )
        self.port = 0
        self.metrics_port: int | None = None
        self.http: HttpEdgeServer | None = None
        self._serving: bool | None = None
        self._tasks = BackgroundTasks()
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def _backend_changed(self, backend: Backend) -> None:
        address = backend.address
        if any(member is backend for member in self.pool.backends):
            self.proxy.events.health(address, backend.healthy, backend.state_name)
            self.proxy.events.role(address, backend.standby)
        else:
            self.proxy.events.removed(address)
        if not backend.eligible:
            # Draining, lost, removed or a standby: its multiplexed calls take nothing new and
            # end with their requests, so a draining server finishes them and is not held open.
            self.proxy.multiplexers.retire(address)
        self.metrics.healthy.labels(address).set(1 if backend.healthy else 0)
        self.metrics.standby.labels(address).set(1 if backend.standby else 0)
        self.metrics.paused.labels(address).set(1 if backend.paused else 0)
        self.metrics.prompt_tokens.labels(address).set(backend.status.prompt_tokens)
        self.metrics.cached_prompt_tokens.labels(address).set(backend.status.cached_prompt_tokens)
        self.metrics.weight_version.labels(address).set(backend.weight_version)
        sessions = self.pool.placement.sessions.live_sessions()
        for member in self.pool.backends:  # zero too: a gauge keeps its last value otherwise
            self.metrics.live_sessions.labels(member.address).set(sessions[member.address])
        serving = bool(self.pool.serving())
        if serving != self._serving:
            self._serving = serving
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for service in ("", DATA_PLANE):
                self._tasks.spawn(self.health.set(service, status))

    async def start(self) -> None:
        self.server.add_generic_rpc_handlers((ForwardingHandler(self.proxy),))
        siblings = None
        options = self.options
        if options.replica is not None and options.replica_ports:
            # Where its siblings call it: replicas share a host, so its loopback (the admin
            # token, if any, still applies).
            own = options.replica_ports[options.replica]
            bind(self.server, f"127.0.0.1:{own}", None)
            siblings = Siblings(
                options.replica,
                [f"127.0.0.1:{port}" for port in options.replica_ports],
                options.admin_token,
            )
        router_pb2_grpc.add_RouterAdminServicer_to_server(
            RouterAdminServicer(self.pool, siblings), self.server
        )
        if siblings is not None:  # a promotion here is a membership change there too
            told = siblings
            self.pool.on_promoted = lambda up, lost: self._tasks.spawn(told.promotion(up, lost))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for service in ("", DATA_PLANE):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(ROUTER_ADMIN, health_pb2.HealthCheckResponse.SERVING)
        reflection.enable_server_reflection(
            [DATA_PLANE, ROUTER_ADMIN, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = bind(self.server, f"{self.options.host}:{self.options.port}", self.options.tls)
        await self.server.start()
        # A replica that starts while its siblings run routes to the fleet they route to now.
        current = await siblings.membership() if siblings is not None else None
        await self.pool.start(current)
        if self.options.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.options.metrics_port, self.options.host)
        if self.options.http_port is not None:
            edge = OpenAIEdge(
                self.proxy,
                self.pool,
                self.options.http_stream_interval,
                self.options.replica,
                LocalTokenizer.load(self.options.tokenizer),
                routed_experts=self.options.routed_experts,
            )
            self.http = HttpEdgeServer(
                edge,
                self.options.host,
                self.options.http_port,
                reuse_port=self.options.replica is not None,
            )
            await self.http.start()
            log.info("OpenAI HTTP edge on http://%s:%d/v1", self.options.host, self.http.port)
        replica = "" if self.options.replica is None else f" (replica {self.options.replica})"
        log.info(
            "router%s listening on %s for %s",
            replica,
            self.address,
            ", ".join(self.options.backends),
        )

    async def wait_ready(self) -> None:
        """The router is ready once it listens: until a backend is healthy its health says
        NOT_SERVING and calls answer UNAVAILABLE."""

    async def wait_healthy(self, count: int = 1, timeout: float = 30) -> None:
        """Waits until ``count`` backends are healthy."""
        deadline = time.monotonic() + timeout
        while len(self.pool.healthy()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.pool.healthy())} of {count} backends healthy")
            await asyncio.sleep(0.05)

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def stop(self, grace: float | None = None) -> None:
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(self.options.drain_grace_seconds if grace is None else grace)
        await self.proxy.multiplexers.close()
        await self.pool.close()
        await self._tasks.close()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(options: RouterOptions) -> None:
    tracing.configure("skyrl-router", options.otlp_traces_endpoint)
    router = RouterServer(options)
    await serve_until_stopped(
        router,
        router.stop,
        lambda: {"metrics_port": router.metrics_port, "http_port": router.http_port},
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging()
    exit_with_supervisor()
    if args.replicas > 1:
        from servers.router.replicas import serve_replicas

        asyncio.run(serve_replicas(args, sys.argv[1:] if argv is None else argv))
        return
    with asyncio.Runner(loop_factory=lambda: new_event_loop(args.event_loop)) as runner:
        runner.run(serve(options_from_args(args)))


if __name__ == "__main__":
    main()
