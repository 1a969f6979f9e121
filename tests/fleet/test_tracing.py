"""Traces across the stack, received over OTLP by a real receiver (the OpenTelemetry
protocol's gRPC TraceService, served here): a request from the HTTP edge forms one trace
through the router to the engine server and vLLM's own span; a weight update from the trainer
client forms one trace with every server's phases. Tracing off is covered by every other test
(the same code paths, with nothing configured)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from safetensors.torch import load_file

from servers.fleet.local import LocalFleet
from skyrl_grpc import tracing
from skyrl_grpc.names import GENERATE_STREAM
from tests.helpers.waits import ENGINE_START_SECONDS, wait_until
from tests.helpers.weights import perturbed
from trainer_client import InferenceClient

pytestmark = [pytest.mark.engine]


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        received = []
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            service = attributes.get("service.name", "")
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    received.append(
                        Span(
                            service,
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            {a.key: a.value for a in span.attributes},
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def in_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    collector = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        collector, server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def traced_fleet(receiver: tuple[Receiver, str]) -> Iterator[LocalFleet]:
    _, endpoint = receiver
    flag = ["--otlp-traces-endpoint", endpoint]
    with LocalFleet(
        2,
        engine_args=flag,
        router_args=["--http-port", "0", *flag],
        start_timeout=ENGINE_START_SECONDS,
    ) as fleet:
        yield fleet


def child_of(spans: list[Span], parent: Span, service: str, name: str) -> Span | None:
    return next(
        (
            s
            for s in spans
            if s.parent_id == parent.span_id and s.service == service and s.name == name
        ),
        None,
    )


async def test_a_request_from_the_edge_is_one_trace_to_the_engine_and_vllm(
    receiver: tuple[Receiver, str], traced_fleet: LocalFleet
) -> None:
    collector, _ = receiver
    trace_id, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    host = traced_fleet.addresses.router.rpartition(":")[0]
    body = {"model": "", "prompt": [1, 4, 5], "max_tokens": 6, "stream": True}
    request = urllib.request.Request(
        f"http://{host}:{traced_fleet.http_port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{caller_span}-01"},
    )
    answer = await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=60).read())
    assert b"[DONE]" in answer

    def whole_trace() -> bool:
        names = {(s.service, s.name) for s in collector.in_trace(trace_id)}
        return {
            ("skyrl-engine-server", "llm_request"),
            ("skyrl-router", "POST /v1/completions"),
        } <= names

    await asyncio.to_thread(wait_until, whole_trace, 60, "the edge's and engine's spans")
    spans = collector.in_trace(trace_id)
    edge = next(s for s in spans if s.name == "POST /v1/completions")
    assert (edge.service, edge.parent_id) == ("skyrl-router", caller_span)
    routed = child_of(spans, edge, "skyrl-router", GENERATE_STREAM)
    assert routed is not None, spans
    # The router's streams to a server share one multiplexed call: each request carries its
    # own trace context, and the server's span of it is named so.
    served = child_of(spans, routed, "skyrl-engine-server", f"{GENERATE_STREAM} (multiplexed)")
    assert served is not None, spans
    # vLLM's own span of the request: its queue, prefill and decode times.
    in_vllm = child_of(spans, served, "skyrl-engine-server", "llm_request")
    assert in_vllm is not None, spans
    assert "gen_ai.latency.time_in_queue" in in_vllm.attributes
    assert "gen_ai.latency.time_in_model_prefill" in in_vllm.attributes


async def test_a_weight_update_is_one_trace_with_every_servers_phases(
    receiver: tuple[Receiver, str], traced_fleet: LocalFleet, tiny_model_dir: Path
) -> None:
    collector, endpoint = receiver
    servers = list(traced_fleet.addresses.servers)
    client = InferenceClient(traced_fleet.addresses.router, servers, otlp_traces_endpoint=endpoint)
    try:
        version = max((await client.weight_versions()).values()) + 1
        weights = perturbed(load_file(str(tiny_model_dir / "model.safetensors")), seed=74)
        await client.update_weights(weights.items(), version)
    finally:
        await client.close()
        tracing.shutdown()  # sends the client's span; this test process traces no more

    def update_span() -> Span | None:
        with collector._lock:
            return next(
                (
                    s
                    for s in collector.spans
                    if s.service == "skyrl-trainer-client" and s.name == "update_weights"
                ),
                None,
            )

    await asyncio.to_thread(wait_until, lambda: update_span() is not None, 30, "the client span")
    root = update_span()
    assert root is not None

    def phases() -> set[tuple[str, str]]:
        spans = collector.in_trace(root.trace_id)
        by_id = {s.span_id: s for s in spans}
        seen = set()
        for span in spans:
            if span.name.startswith("weight_update.") and span.parent_id in by_id:
                # The phase's parent is the server's span of the call that ran it.
                call = by_id[span.parent_id]
                seen.add((call.service, span.name))
        return seen

    def every_server_committed() -> bool:
        spans = collector.in_trace(root.trace_id)
        commits = [s for s in spans if s.name == "weight_update.commit"]
        return len(commits) == len(servers)

    await asyncio.to_thread(wait_until, every_server_committed, 30, "each server's commit span")
    assert {
        ("skyrl-engine-server", "weight_update.start"),
        ("skyrl-engine-server", "weight_update.commit"),
    } <= phases()
    starts = [s for s in collector.in_trace(root.trace_id) if s.name == "weight_update.start"]
    assert len(starts) == len(servers)
