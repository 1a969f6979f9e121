"""Every call a gRPC server handles, as Prometheus metrics named as grpc-prometheus (the Go
and Java servers' convention, which dashboards and alerts already read): calls started,
calls handled by status code, and how long they took, by service, method and kind. The error
interceptor reports each call here (``interceptors.CallObserver``)."""

from __future__ import annotations

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

# Seconds: a health check's milliseconds to a paused stream's minutes.
HANDLING_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
LABELS = ["grpc_type", "grpc_service", "grpc_method"]


class GrpcServerMetrics:
    """``grpc_server_started_total``, ``grpc_server_handled_total`` (with ``grpc_code``) and
    ``grpc_server_handling_seconds``, in ``registry``."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._started = Counter(
            "grpc_server_started", "RPCs started on the server", LABELS, registry=registry
        )
        self._handled = Counter(
            "grpc_server_handled",
            "RPCs completed on the server, by status code",
            [*LABELS, "grpc_code"],
            registry=registry,
        )
        self._seconds = Histogram(
            "grpc_server_handling_seconds",
            "Seconds from an RPC's start to its status",
            LABELS,
            buckets=HANDLING_BUCKETS,
            registry=registry,
        )

    @staticmethod
    def _labels(method: str, kind: str) -> tuple[str, str, str]:
        _, service, name = method.split("/", 2) if method.count("/") >= 2 else ("", "", method)
        return kind, service, name

    def started(self, method: str, kind: str) -> None:
        self._started.labels(*self._labels(method, kind)).inc()

    def handled(self, method: str, kind: str, code: grpc.StatusCode, seconds: float) -> None:
        labels = self._labels(method, kind)
        self._handled.labels(*labels, code.name).inc()
        self._seconds.labels(*labels).observe(seconds)
