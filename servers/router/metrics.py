"""Prometheus metrics of the router, on a registry of its own (served over HTTP)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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


class RouterMetrics:
    """Requests, errors by code, latency, in-flight per backend, backend health; with
    ``replica``, which of the router's replicas this is (``skyrl_router_replica_info``: each
    replica serves its own /metrics, on its own port)."""

    def __init__(self, replica: int | None = None) -> None:
        self.registry = CollectorRegistry()
        if replica is not None:
            Gauge(
                "skyrl_router_replica_info",
                "This router is one of several replicas sharing its ports: which one",
                ["replica"],
                registry=self.registry,
            ).labels(str(replica)).set(1)
        self.requests = Counter(
            "skyrl_router_requests",
            "Calls forwarded",
            ["method", "backend"],
            registry=self.registry,
        )
        self.errors = Counter(
            "skyrl_router_errors",
            "Calls that ended with a non-OK status",
            ["method", "code"],
            registry=self.registry,
        )
        self.retries = Counter(
            "skyrl_router_retries",
            "Calls retried on another backend before their first response",
            ["method"],
            registry=self.registry,
        )
        self.migrations = Counter(
            "skyrl_router_migrations",
            "Streams moved to another backend after theirs died",
            ["method"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "skyrl_router_request_seconds",
            "Time from call start to its end (whole stream)",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "skyrl_router_in_flight",
            "Calls in flight per backend",
            ["backend"],
            registry=self.registry,
        )
        self.paused = Gauge(
            "skyrl_router_backend_paused",
            "1 if the backend reports its generation paused",
            ["backend"],
            registry=self.registry,
        )
        self.live_sessions = Gauge(
            "skyrl_router_backend_live_sessions",
            "Sessions living on the backend (as it reports them, plus placements it has not "
            "reported yet)",
            ["backend"],
            registry=self.registry,
        )
        self.prompt_tokens = Gauge(
            "skyrl_router_backend_prompt_tokens",
            "Prompt tokens the backend has served (its running total)",
            ["backend"],
            registry=self.registry,
        )
        self.cached_prompt_tokens = Gauge(
            "skyrl_router_backend_cached_prompt_tokens",
            "Prompt tokens the backend served from its prefix cache (its running total)",
            ["backend"],
            registry=self.registry,
        )
        self.healthy = Gauge(
            "skyrl_router_backend_healthy",
            "1 if the backend receives traffic",
            ["backend"],
            registry=self.registry,
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Starts the /metrics HTTP endpoint; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
