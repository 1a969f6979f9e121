"""Prometheus metrics of the router, on a registry of its own (served over HTTP).

Names follow vllm-router's (``vllm_router_processed_requests_total{worker}``,
``..._request_errors_total``, ``..._retries_total``, ``..._request_duration_seconds``,
``..._running_requests``, ``..._worker_health``, ``..._policy_decisions_total``) and SMG's
(``smg_router_ttft_seconds``, ``smg_router_tokens_total{token_type}``,
``smg_http_requests_total``) where they mean the same, with ``skyrl_router_`` in front and
``worker`` the backend's address; vLLM's own ``inter_token_latency_seconds`` names the ITL.
``docs/observability.md`` lists each one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from servers.router.loop_series import (
    LoopCounter,
    LoopCounterFamily,
    LoopHistogram,
    LoopHistogramFamily,
)

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)
# vLLM's own buckets for its time-to-first-token and inter-token-latency histograms.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class RouterMetrics:
    """Requests, errors, latency, tokens and placements per worker (backend), the workers'
    health and reports, and the HTTP edge's requests; with ``replica``, which of the router's
    replicas this is (``skyrl_router_replica_info``: each replica serves its own /metrics, on
    its own port)."""

    def __init__(self, replica: int | None = None) -> None:
        self.registry = registry = CollectorRegistry()
        if replica is not None:
            Gauge(
                "skyrl_router_replica_info",
                "This router is one of several replicas sharing its ports: which one",
                ["replica"],
                registry=registry,
            ).labels(str(replica)).set(1)
        self.requests = Counter(
            "skyrl_router_processed_requests",
            "Calls (and requests of batches) sent to a worker, attempts on other workers "
            "after a failure included",
            ["method", "worker"],
            registry=registry,
        )
        self.errors = Counter(
            "skyrl_router_request_errors",
            "Calls that ended with a non-OK status, by the worker they ended on ('' when none)",
            ["method", "code", "worker"],
            registry=registry,
        )
        self.retries = Counter(
            "skyrl_router_retries",
            "Calls retried on another worker before their first response",
            ["method"],
            registry=registry,
        )
        self.migrations = Counter(
            "skyrl_router_migrations",
            "Streams moved to another worker after theirs died",
            ["method"],
            registry=registry,
        )
        self.held = Histogram(
            "skyrl_router_held_seconds",
            "Calls held while no worker served, until one served again or in vain (--hold-seconds)",
            ["outcome"],
            buckets=(0.5, 1, 2, 5, 10, 30, 60),
            registry=registry,
        )
        self.latency = Histogram(
            "skyrl_router_request_duration_seconds",
            "Time from call start to its end (whole stream)",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # Recorded per relayed message: series the event loop writes without locks.
        self.ttft = LoopHistogramFamily(
            "skyrl_router_ttft_seconds",
            "Generation streams: time from the call's start to its first tokens, by the worker "
            "that sent them",
            ["worker"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = LoopHistogramFamily(
            "skyrl_router_inter_token_latency_seconds",
            "Generation streams: time between two messages divided by the tokens of the later "
            "(one observation per message)",
            ["worker"],
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.tokens = LoopCounterFamily(
            "skyrl_router_tokens",
            "Tokens relayed by generation streams, by worker (token_type 'output')",
            ["worker", "token_type"],
            registry=registry,
        )
        self.decisions = Counter(
            "skyrl_router_policy_decisions",
            "Placements: 'load' (no session: least loaded), 'session_home' (a session kept on "
            "its worker), 'session_placed' (a session placed or moved)",
            ["worker", "decision"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "skyrl_router_running_requests",
            "Calls in flight per worker",
            ["worker"],
            registry=registry,
        )
        self.paused = Gauge(
            "skyrl_router_worker_paused",
            "1 if the worker reports its generation paused",
            ["worker"],
            registry=registry,
        )
        self.live_sessions = Gauge(
            "skyrl_router_worker_live_sessions",
            "Sessions living on the worker (as it reports them, plus placements it has not "
            "reported yet)",
            ["worker"],
            registry=registry,
        )
        self.prompt_tokens = Gauge(
            "skyrl_router_worker_prompt_tokens",
            "Prompt tokens the worker has served (its running total)",
            ["worker"],
            registry=registry,
        )
        self.cached_prompt_tokens = Gauge(
            "skyrl_router_worker_cached_prompt_tokens",
            "Prompt tokens the worker served from its prefix cache (its running total)",
            ["worker"],
            registry=registry,
        )
        self.healthy = Gauge(
            "skyrl_router_worker_health",
            "1 if the worker passes its health checks (a standby too)",
            ["worker"],
            registry=registry,
        )
        self.standby = Gauge(
            "skyrl_router_worker_standby",
            "1 if the worker is a warm standby: kept current, given no data-plane calls",
            ["worker"],
            registry=registry,
        )
        self.weight_version = Gauge(
            "skyrl_router_worker_weight_version",
            "The weight version the worker reports serving",
            ["worker"],
            registry=registry,
        )
        self.http_requests = Counter(
            "skyrl_router_http_requests",
            "HTTP edge requests by route and status code",
            ["route", "status"],
            registry=registry,
        )
        self.http_latency = Histogram(
            "skyrl_router_http_request_duration_seconds",
            "HTTP edge requests: time from the request to the end of its answer",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._stream_series: dict[str, tuple[LoopCounter, LoopHistogram, LoopHistogram]] = {}

    def stream_series(self, worker: str) -> tuple[LoopCounter, LoopHistogram, LoopHistogram]:
        """A worker's output-token counter, TTFT and ITL histograms, looked up once: a stream
        observes them per message (from the event loop only)."""
        series = self._stream_series.get(worker)
        if series is None:
            series = self._stream_series[worker] = (
                self.tokens.labels(worker, "output"),
                self.ttft.labels(worker),
                self.itl.labels(worker),
            )
        return series

    def http_request(self, route: str, status: int, seconds: float) -> None:
        """One HTTP edge request answered (``asgi.Observer``)."""
        self.http_requests.labels(route, str(status)).inc()
        self.http_latency.labels(route).observe(seconds)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Starts the /metrics HTTP endpoint; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
