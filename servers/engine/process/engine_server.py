"""The engine server process: DataPlane + ControlPlane over one vLLM engine (and vLLM's own
VllmEngine protocol beside them: ``service.vllm_protocol``), with health and
reflection.

Lifecycle (each step is visible in ``grpc.health.v1``):
1. the gRPC port opens at once, before vLLM is even imported; liveness (service ``""``) is
   SERVING, the DataPlane and ControlPlane services are NOT_SERVING and their calls answer
   UNAVAILABLE;
2. the engine starts in the background and generates a few tokens (warm-up); a server started
   with ``--catch-up-from`` then reads its fleet's current weights from a peer (``catch_up``);
   only then do both services turn SERVING. A model it cannot run fails here: the process exits
   non-zero with the cause as its last log line, never having reported SERVING;
3. if the engine dies later (its process killed, a kernel crash), every service turns
   NOT_SERVING at once, calls answer UNAVAILABLE naming the cause, the server drains and exits
   non-zero, so a supervisor restarts it and routers stop feeding it;
4. on SIGTERM (or ``drain()``), every service turns NOT_SERVING first (routers stop sending),
   in-flight calls get ``drain_grace_seconds`` to finish (health watches are not waited for),
   then the engine shuts down.

vLLM's logs go to stderr (``engine_logs``); stdout carries only the JSON lifecycle lines. The
engine's processes die with the server whatever kills it (``servers.common.reaper``).

Run: ``skyrl-grpc serve --port 50051`` or ``python -m servers.engine`` (both call ``run``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from pathlib import Path
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from servers.common.event_loops import new_event_loop
from servers.common.interceptors import BearerTokenInterceptor, CallCounter, ErrorMappingInterceptor
from servers.common.listener import RECEIVE_HEADROOM, bind, server_options
from servers.common.process import (
    announce,
    configure_logging,
    exit_now,
    run_until_done,
    serve_until_stopped,
)
from servers.common.reaper import exit_with_supervisor, reap_children_on_exit
from servers.common.tasks import BackgroundTasks
from servers.engine.domain.admission import Admission
from servers.engine.domain.descriptions import ServingStatus
from servers.engine.domain.live_sessions import LiveSessions
from servers.engine.domain.weights.serving import WeightsCannotReload
from servers.engine.options import (
    STAGING_AT_FIRST_GENERATION,
    STAGING_AT_FIRST_UPDATE,
    ServerOptions,
    build_parser,
    options_from_args,
)
from servers.engine.peers.catch_up import catch_up
from servers.engine.peers.peer_streams import PeerAccess
from servers.engine.peers.relay import Relays
from servers.engine.process.engine_parts import EngineParts
from servers.engine.process.scratch import use_scratch_directory
from servers.engine.process.server_metrics import ServerMetrics
from servers.engine.process.serving_state import ServingState
from servers.engine.service.control_plane import ControlPlaneServicer, add_control_plane
from servers.engine.service.data_plane import DataPlaneServicer
from servers.engine.service.push_socket import PushSocketServer
from servers.engine.service.status import ServerStatusServicer, StatusChanges
from servers.engine.service.vllm_api import CONTROL, INFERENCE, ServerIdentity, add_vllm_api
from servers.engine.service.vllm_protocol import (
    VLLM_ENGINE,
    VLLM_ENGINE_OPEN,
    VllmEngineService,
    add_vllm_engine,
)
from servers.engine.service.weight_streams import WeightStreams
from servers.engine.vllm_adapter.engine_logs import root_cause, route_vllm_logs
from servers.engine.vllm_adapter.vllm_engine import EngineCannotRun, VllmEngine
from skyrl_grpc import tracing
from skyrl_grpc.host_memory import keep_freed_memory
from skyrl_grpc.names import CONTROL_PLANE, DATA_PLANE, GENERATE_BATCH, SERVER_STATUS
from skyrl_grpc.v1 import data_plane_pb2_grpc, status_pb2_grpc

log = logging.getLogger(__name__)
DATA_PLANE_PREFIX = f"/{DATA_PLANE}/"
# The services that answer only while the engine serves (health says NOT_SERVING otherwise).
GENERATING_SERVICES = (DATA_PLANE, CONTROL_PLANE, VLLM_ENGINE, INFERENCE, CONTROL)
# How often the engine's liveness is checked (vLLM notices its process exit at once).
ENGINE_WATCH_SECONDS = 0.2
# How often idle sessions are looked for (at most; a quarter of the idle time if shorter).
SESSION_EXPIRY_CHECK_SECONDS = 5.0
# In-flight calls of a dead engine fail at once; this only lets their answers go out.
DEAD_ENGINE_GRACE_SECONDS = 2.0
# How long a server whose engine died stays up after turning NOT_SERVING, so watchers see it.
NOT_SERVING_NOTICE_SECONDS = 0.3


class EngineServer:
    """Builds and runs the server; ``start()`` returns once the port is open.

    ``failure`` is set when the engine could not start, failed its warm-up or died; the
    process then exits non-zero (``serve``).
    """

    def __init__(self, options: ServerOptions, errors: Path | None = None) -> None:
        self.options = options
        # vLLM's error records (engine_logs), read to name why an engine failed or died.
        self.errors = errors
        self.state: ServingState[EngineParts] = ServingState()
        self.health = health.aio.HealthServicer()
        self.calls = CallCounter()
        # The data plane's admission (its ``queued`` is read by tests).
        limits = options.limits
        self.admission = Admission(limits.max_concurrent_samples, limits.max_queued_requests)
        data_token = options.data_token or ""
        # vLLM's own protocol generates as the DataPlane does: the data plane's token guards it.
        tokens = {CONTROL_PLANE: options.control_token or "", DATA_PLANE: data_token}
        tokens[VLLM_ENGINE] = tokens[INFERENCE] = data_token
        tokens[CONTROL] = tokens[CONTROL_PLANE]  # vLLM's Control as our ControlPlane
        # Prometheus metrics, when asked for (``--metrics-port``).
        self.metrics = (
            ServerMetrics(self._serving_status) if options.metrics_port is not None else None
        )
        self.metrics_port: int | None = None
        self.server = grpc.aio.server(
            interceptors=[
                BearerTokenInterceptor(tokens, open_methods=VLLM_ENGINE_OPEN),
                ErrorMappingInterceptor(
                    counter=self.calls,
                    counted_services=(DATA_PLANE, CONTROL_PLANE, INFERENCE, CONTROL),
                    size_limit=self._request_size_limit,
                    max_message_bytes=options.max_message_bytes,
                    observer=self.metrics.grpc if self.metrics is not None else None,
                ),
            ],
            options=server_options(options.max_message_bytes, RECEIVE_HEADROOM),
        )
        self.status_changes = StatusChanges()
        # How this server calls its peers: to catch up, and to relay weight updates.
        self.peer_access = PeerAccess(
            options.control_token, options.max_message_bytes, options.peer_tls
        )
        # Weight streams in, by PushWeights or the push socket, relayed down the update's
        # relay plan.
        self.weight_streams = WeightStreams(
            lambda: self.state.parts().weights.updates, Relays(self.peer_access)
        )
        self.push_socket: PushSocketServer | None = None
        # vLLM's own protocol on this server (``service.vllm_protocol``), once started.
        self.vllm_engine: VllmEngineService | None = None
        self.data_plane: DataPlaneServicer | None = None
        self.port = 0
        self.failure: str | None = None
        self._engine_task: asyncio.Task[None] | None = None
        self._tasks = BackgroundTasks()
        self._stopped = asyncio.Event()
        self._shutdown: asyncio.Task[None] | None = None

    def _serving_status(self) -> ServingStatus | None:
        """What ServerStatus streams now (None before the engine serves)."""
        parts = self.state.started
        return None if parts is None else parts.serving_status()

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def _request_size_limit(self, method: str) -> tuple[int, str] | None:
        """No valid DataPlane request is larger than its longest prompt (5 bytes per token id,
        or the longest token's text) plus 1 MiB for everything else it may carry. A batch is
        bounded by the message size and its count of requests (``validate.batch``); every
        message by --max-message-mib, which the error interceptor checks first."""
        parts = self.state.started
        if parts is None or not method.startswith(DATA_PLANE_PREFIX) or method == GENERATE_BATCH:
            return None
        tokens = parts.limits.max_prompt_tokens
        limit = tokens * max(5, parts.tokenizer.longest_token_bytes) + (1 << 20)
        return (
            limit,
            f"{limit} bytes, which a prompt of {tokens} tokens (--max-prompt-tokens) needs",
        )

    def _open_push_socket(self) -> PushSocketServer | None:
        """The push socket, unless turned off or the server serves TLS (it is not encrypted)."""
        options = self.options
        if options.weight_push_port < 0 or options.tls is not None:
            return None
        return PushSocketServer(
            options.host,
            options.weight_push_port,
            self.weight_streams,
            max_frame_bytes=options.max_message_bytes,
            calls=self.calls,
        )

    async def start(self) -> None:
        # Each servicer gets its parts from the builder (``EngineParts``) once the engine
        # serves; until then they answer UNAVAILABLE (``ServingState.parts``).
        state = self.state
        data_plane = DataPlaneServicer(lambda: state.parts().data_plane, self.admission)
        data_plane_pb2_grpc.add_DataPlaneServicer_to_server(data_plane, self.server)
        self.data_plane = data_plane
        self.push_socket = self._open_push_socket()
        push_port = self.push_socket.port if self.push_socket is not None else 0
        control = ControlPlaneServicer(
            lambda: state.parts().control_plane, self.weight_streams, push_port
        )
        add_control_plane(control, self.server)
        self.vllm_engine = add_vllm_engine(lambda: state.parts().engine, self.server)
        engine = self.options.engine
        add_vllm_api(
            self.server,
            data_plane,
            control,
            lambda: (state.parts().control_plane, state.parts().data_plane),
            ServerIdentity(uuid.uuid4().hex, engine.tool_call_parser, engine.reasoning_parser),
            self._shutdown_soon,
        )

        status = ServerStatusServicer(
            self._serving_status, lambda: state.draining, self.status_changes, engine.seed
        )
        status_pb2_grpc.add_ServerStatusServicer_to_server(status, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [
                DATA_PLANE,
                CONTROL_PLANE,
                SERVER_STATUS,
                VLLM_ENGINE,
                INFERENCE,
                CONTROL,
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ],
            self.server,
        )
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        for service in GENERATING_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = bind(self.server, f"{self.options.host}:{self.options.port}", self.options.tls)
        await self.server.start()
        if self.push_socket is not None:
            self.push_socket.start()
        if self.metrics is not None and self.options.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.options.metrics_port, self.options.host)
        log.info("listening on %s; starting the engine", self.address)
        self._engine_task = asyncio.create_task(self._start_engine())

    async def _start_engine(self) -> None:
        if self.options.keep_freed_memory:  # before vLLM starts its engine-core process
            keep_freed_memory()
        try:
            parts = await EngineParts.start(
                self.options.engine,
                self.options.limits,
                self.status_changes.announce,
                self.errors,
                self.metrics.phase if self.metrics is not None else None,
            )
            # A drain shuts it down from now on; calls wait until it is warm and caught up
            # (a pause from a trainer would otherwise stall the warm-up or the catch-up).
            self.state.set_ready(parts)
            staging = self.options.engine.weight_staging
            if staging != STAGING_AT_FIRST_UPDATE:  # the warm-up below generates with it
                await parts.weights.reload_at_start(trim=staging == STAGING_AT_FIRST_GENERATION)
            await parts.weights.readiness.at_start()  # the staging memory, with "start"
            await parts.engine.warm_up()
            if self.options.catch_up_from:  # before anything is served: nobody sees it behind
                peers = self.options.catch_up_from
                started = time.monotonic()
                with tracing.span("catch_up", {"skyrl.peers": ",".join(peers)}) as span:
                    outcome = await catch_up(parts.catch_up, peers, self.peer_access)
                    if span is not None:
                        span.set_attribute("skyrl.catch_up.outcome", outcome)
                if self.metrics is not None:
                    self.metrics.caught_up(time.monotonic() - started, outcome)
                log.info("catch-up: %s", outcome)
        except Exception as error:
            self.failure = (
                str(error)
                if isinstance(error, EngineCannotRun | WeightsCannotReload)
                else f"the engine failed to start: {root_cause(self.errors) or error}"
            )
            log.debug("engine start failed", exc_info=error)
            await self.drain(grace=0)
            raise
        # Everything built so far (vLLM, torch, the model's tokenizer: millions of objects)
        # lives as long as the process: keep it out of the collector's full passes, which
        # otherwise stop every thread for hundreds of milliseconds under load.
        gc.collect()
        gc.freeze()
        self.state.set_serving()
        for service in GENERATING_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.status_changes.announce()
        self._tasks.spawn(self._watch_engine(parts.engine), name="engine watch")
        self._tasks.spawn(self._expire_sessions(parts.sessions), name="session expiry")
        log.info("engine ready: %s serving %s", self.address, parts.engine.served_model_name)

    async def _watch_engine(self, engine: VllmEngine) -> None:
        """Turns the server NOT_SERVING and drains it as soon as the engine dies: a server
        whose engine is gone must not look healthy to the routers feeding it."""
        # vLLM sets the flag from its own monitor thread: there is no event to wait on.
        while not engine.dead:  # noqa: ASYNC110
            await asyncio.sleep(ENGINE_WATCH_SECONDS)
        if self.state.draining:
            return  # a shutdown in progress stops the engine on purpose
        self.failure = f"the engine died: {engine.death_cause()}"
        self.state.dead = self.failure
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING at once
        log.error("%s; draining and exiting", self.failure)
        # Let health watchers receive NOT_SERVING before the connections close: with nothing
        # in flight (callers that route themselves move at the first UNAVAILABLE) the drain
        # below ends at once, and a watcher would see a broken stream instead.
        await asyncio.sleep(NOT_SERVING_NOTICE_SECONDS)
        await self.drain(grace=DEAD_ENGINE_GRACE_SECONDS)

    async def _expire_sessions(self, sessions: LiveSessions) -> None:
        """Ends idle sessions, so placers stop counting them."""
        every = min(sessions.idle_seconds / 4, SESSION_EXPIRY_CHECK_SECONDS)
        while True:
            await asyncio.sleep(every)
            sessions.expire()  # announces what it ended

    async def wait_ready(self) -> EngineParts:
        """Waits for the engine (started and warmed up); raises if it failed."""
        assert self._engine_task is not None, "start() first"
        await asyncio.shield(self._engine_task)
        return self.state.parts()

    async def drain(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, then let in-flight calls finish within ``grace``, then stop.

        Only calls of the DataPlane and ControlPlane, and the push socket's streams, are waited
        for: long-lived health watches (every router holds one) are ended with the server, not
        waited on.
        """
        if self.state.draining:
            await self._stopped.wait()
            return
        self.state.draining = True
        if self.data_plane is not None:  # a caller's idle multiplexed call holds no drain up
            self.data_plane.end_multiplexed_calls()
        self.status_changes.announce()
        await self.health.enter_graceful_shutdown()
        grace = self.options.drain_grace_seconds if grace is None else grace
        if not await self.calls.wait_idle(grace):
            log.warning("%d calls still running after the %.0f s grace", self.calls.active, grace)
        await self.server.stop(0)
        if self.push_socket is not None:
            await self.push_socket.close()
        if self.metrics is not None:
            self.metrics.close()
        task = self._engine_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        await self._tasks.close()
        parts = self.state.started
        if parts is not None:
            await parts.shutdown()
        self._stopped.set()
        log.info("stopped %s", self.address)

    def _shutdown_soon(self) -> None:
        """vLLM's Control.Shutdown: drains as SIGTERM does, once the call has answered."""
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_task(self.drain())

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(options: ServerOptions, errors: Path | None = None) -> None:
    """Runs a server until it is stopped; exits non-zero, with the cause as the last log
    line, if its engine failed to start, failed its warm-up or died."""
    server = EngineServer(options, errors)
    try:
        await serve_until_stopped(
            server, server.drain, lambda: {"metrics_port": server.metrics_port}
        )
    except Exception:
        if server.failure is None:
            raise
    else:
        if server.failure is not None:  # it was serving, then its engine died
            announce("failed", address=server.address, error=server.failure)
    if server.failure is not None:
        _stop_resource_tracker()
        log.error("%s", server.failure)  # the last line of the log says why
        raise SystemExit(1)


def _stop_resource_tracker() -> None:
    """multiprocessing's resource tracker (vLLM starts one) prints its warnings as it exits,
    after this process; stopping it first keeps the failure's cause the log's last line."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)  # private, since 3.8
    if stop is not None:
        stop()


def run(options: ServerOptions) -> NoReturn:
    """The engine server as a process: the one entry point of every command that starts one
    (``skyrl-grpc serve``, ``python -m servers.engine``, the launchers). Routes vLLM's logs to
    stderr (before vLLM is imported), ties the engine's processes to this one (they die with it,
    however it dies), serves until stopped, and exits without the interpreter's teardown."""
    configure_logging()
    tracing.configure("skyrl-engine-server", options.engine.otlp_traces_endpoint)
    scratch = use_scratch_directory()
    errors = route_vllm_logs(scratch)
    reap_children_on_exit(remove=scratch)
    exit_with_supervisor()
    code = 0
    try:
        run_until_done(serve(options, errors), new_event_loop(options.engine.event_loop))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # said, and the process still ends now, its threads with it
        log.exception("the server ended abnormally")
        code = 1
    exit_now(code)


def main(argv: list[str] | None = None) -> NoReturn:
    run(options_from_args(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
