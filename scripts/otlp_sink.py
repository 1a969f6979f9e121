"""An OTLP/gRPC trace receiver for the benchmarks: it takes what the stack exports, counts the
spans and keeps nothing else (a collector's cost is not the stack's)."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class SpanCounter(trace_service_pb2_grpc.TraceServiceServicer):
    """Counts the spans it is sent."""

    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request: Any, context: Any) -> Any:
        self.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpSink:
    """A started receiver on 127.0.0.1 (``endpoint``, for ``--otlp-traces-endpoint``)."""

    def __init__(self) -> None:
        self.counter = SpanCounter()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        add_servicer: Any = trace_service_pb2_grpc.add_TraceServiceServicer_to_server  # untyped
        add_servicer(self.counter, self._server)
        self.endpoint = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0)
