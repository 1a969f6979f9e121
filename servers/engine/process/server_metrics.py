"""What an engine server tells Prometheus (``--metrics-port``): vLLM's own metrics, as vLLM's
server exports them (``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``, ...:
vLLM's stat loggers record them in this process, where its ``AsyncLLM`` runs), and this
server's own: the weight version it serves, whether it is paused, its live sessions, every
weight update phase's duration and bytes, its catch-up, and every gRPC call
(``grpc_server_handled_total``, ``grpc_server_handling_seconds``: ``grpc_metrics``).
docs/observability.md lists each metric."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

from servers.common.grpc_metrics import GrpcServerMetrics
from servers.engine.domain.descriptions import ServingStatus

# Seconds of a weight update's phases: a delta's milliseconds to a large model's minutes.
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)


class _Forwarded:
    """A collector yielding another registry's metrics (vLLM's, in the process's default one),
    so one endpoint serves both."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        return self._registry.collect()


class ServerMetrics:
    """The server's metrics; ``status()`` gives what ServerStatus streams (None before the
    engine serves)."""

    def __init__(self, status: Callable[[], ServingStatus | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Forwarded(REGISTRY))
        self.grpc = GrpcServerMetrics(self.registry)

        def read(field: Callable[[ServingStatus], float]) -> Callable[[], float]:
            def value() -> float:
                now = status()
                return float("nan") if now is None else float(field(now))

            return value

        for name, help_text, field in (
            ("skyrl_server_weight_version", "The weight version this server serves",
             lambda s: s.weight_version),
            ("skyrl_server_paused", "1 while generation is paused", lambda s: int(s.paused)),
            ("skyrl_server_live_sessions", "Sessions live on this server",
             lambda s: len(s.sessions)),
        ):  # fmt: skip
            Gauge(name, help_text, registry=self.registry).set_function(read(field))
        self._phase_seconds = Histogram(
            "skyrl_weight_update_phase_seconds",
            "Seconds of each weight update phase that ended well: start, transfer (a stream or "
            "a broadcast), commit, rollback",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self._phase_bytes = Counter(
            "skyrl_weight_update_bytes",
            "Weight bytes received by transfers that were staged",
            registry=self.registry,
        )
        self._catch_up_seconds = Gauge(
            "skyrl_catch_up_seconds",
            "Seconds this server's catch-up from its peers took at its start (0: none)",
            registry=self.registry,
        )
        self._catch_ups = Counter(
            "skyrl_catch_ups", "Catch-ups from peers at start", ["outcome"], registry=self.registry
        )

    def phase(self, name: str, seconds: float, nbytes: int) -> None:
        self._phase_seconds.labels(name).observe(seconds)
        if nbytes:
            self._phase_bytes.inc(nbytes)

    def caught_up(self, seconds: float, outcome: str) -> None:
        """A catch-up took ``seconds`` and came to ``outcome`` (``catch_up``'s sentence)."""
        self._catch_up_seconds.set(seconds)
        if outcome.startswith("caught up"):
            result = "caught_up"
        elif outcome.startswith("stays behind"):
            result = "behind"
        else:
            result = "current"
        self._catch_ups.labels(result).inc()

    def serve(self, port: int, host: str) -> int:
        """Serves /metrics (in a thread) until ``close``; returns the bound port. Always in
        Prometheus' text format: negotiated to OpenMetrics, prometheus_client writes vLLM's
        names with ``_`` for ``:`` (``vllm_num_requests_running``), which no vLLM dashboard
        reads."""
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # a scrape a second is not news

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, daemon=True, name="metrics").start()
        return int(self._http.server_port)

    def close(self) -> None:
        http = getattr(self, "_http", None)
        if http is not None:
            http.shutdown()
            http.server_close()
