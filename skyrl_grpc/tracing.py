"""OpenTelemetry traces across the stack: one switch per process, and the W3C trace context
carried in gRPC metadata (``traceparent`` / ``tracestate``, as SMG and vLLM carry it).

``configure(service, endpoint)`` (``--otlp-traces-endpoint``, vLLM's flag; the trainer client's
``otlp_traces_endpoint``) exports this process's spans over OTLP/gRPC to ``endpoint``. Until then
every function here is a check of one module global and returns at once: tracing off costs
nothing, and opentelemetry is not even imported.

- ``server_span(name, metadata)``: a span for a call this process serves, a child of the
  caller's context when its metadata carries one, made current for the code that serves it
  (contextvars: what that code calls and the spans it starts are its children).
- ``span(name)``: a span inside the current one (a phase, a catch-up).
- ``with_context(metadata)``: the metadata to send on, its trace context replaced by the current
  span's (a router passes its own span on, not its caller's).
- ``headers()``: the current context as W3C headers (what vLLM's ``trace_headers`` takes).
- ``traced(name)``: a decorator, each call of a coroutine function in a span (the trainer
  client's ``update_weights``: every server's phases of one update in one trace).
- ``record(name, seconds)``: a span that has just ended, of ``seconds`` (a weight update's
  phase, timed by its own code).
- ``parse_traceparent`` / ``format_traceparent``: the W3C header read and written here, as
  OpenTelemetry's propagator reads and writes it, without its per-call machinery (every traced
  call carries the context twice or three times through the router).
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
import types
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

V = TypeVar("V")
R = TypeVar("R")
P = ParamSpec("P")
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_CONTEXT_KEYS = (TRACEPARENT, TRACESTATE)
# W3C Trace Context's traceparent, as OpenTelemetry's propagator matches it: version, trace id,
# parent span id, flags, and what a later version may add.
_TRACEPARENT = re.compile(
    r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
)

_tracer: Any = None  # an opentelemetry Tracer once configured; None: tracing is off
_provider: Any = None
_otel: Any = None  # the opentelemetry names used per call, imported once by configure


def enabled() -> bool:
    return _tracer is not None


def configure(service: str, endpoint: str | None) -> None:
    """Exports this process's spans to the OTLP/gRPC ``endpoint`` (``host:port`` or a URL)
    as ``service``; None or '' leaves tracing off. Spans leave in batches, off the caller's
    path; the provider flushes at exit."""
    global _tracer, _provider, _otel
    if not endpoint:
        return
    from opentelemetry import context, trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    insecure = not endpoint.startswith("https://")
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
    # The global provider: libraries that trace through it (vLLM's llm_request span) export
    # through this one too. vLLM's own attempt to set another is refused with a warning.
    trace.set_tracer_provider(provider)
    _provider = provider
    _otel = types.SimpleNamespace(
        Context=context.Context,
        NonRecordingSpan=trace.NonRecordingSpan,
        SpanContext=trace.SpanContext,
        SpanKind=trace.SpanKind,
        TraceFlags=trace.TraceFlags,
        TraceState=trace.TraceState,
        get_current_span=trace.get_current_span,
        set_span_in_context=trace.set_span_in_context,
    )
    _tracer = provider.get_tracer("skyrl_grpc")


def shutdown() -> None:
    """Sends what is buffered and turns tracing off in this process (a test that turned it on;
    a process's own exit flushes by itself)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def parse_traceparent(header: str) -> tuple[int, int, int] | None:
    """A W3C ``traceparent``'s (trace id, parent span id, flags); None where OpenTelemetry's
    propagator would refuse it (malformed, too long, version ff, zero ids, extra fields on
    version 00)."""
    match = _TRACEPARENT.match(header) if len(header) <= 512 else None
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    if trace_hex == "0" * 32 or span_hex == "0" * 16:
        return None
    return int(trace_hex, 16), int(span_hex, 16), int(flags_hex, 16)


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The version-00 ``traceparent`` of a span context (as the propagator injects it)."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def _parent(metadata: Iterable[tuple[str, Any]] | Mapping[str, Any] | None) -> Any:
    """The caller's context from its ``traceparent`` / ``tracestate``, parsed as W3C Trace
    Context says (what OpenTelemetry's TraceContextTextMapPropagator does, without its carrier
    getters and per-call objects: this runs for every call). None when the metadata
    carries none (the span is then a child of the current one); a root context for an invalid
    one (the span starts a trace of its own, as after the propagator's extract)."""
    traceparent = tracestate = None
    for key, value in metadata.items() if isinstance(metadata, Mapping) else (metadata or ()):
        if key == TRACEPARENT:
            traceparent = value.decode() if isinstance(value, bytes) else str(value)
        elif key == TRACESTATE:
            tracestate = value.decode() if isinstance(value, bytes) else str(value)
    if traceparent is None:
        return None
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return _otel.Context()
    trace_id, span_id, flags = parsed
    # The propagator drops a tracestate over 512 characters, and so does this.
    state = (
        _otel.TraceState.from_header([tracestate])
        if tracestate and len(tracestate) <= 512
        else None
    )
    context = _otel.SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=_otel.TraceFlags(flags), trace_state=state
    )
    return _otel.set_span_in_context(_otel.NonRecordingSpan(context))


@contextlib.contextmanager
def server_span(
    name: str,
    metadata: Iterable[tuple[str, Any]] | Mapping[str, Any] | None,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Any]:
    """A SERVER span for a call (None and nothing else when tracing is off)."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(
        name, context=_parent(metadata), kind=_otel.SpanKind.SERVER, attributes=attributes
    ) as current:
        yield current


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """An INTERNAL span inside the current one (None when tracing is off)."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, attributes=attributes) as current:
        yield current


def traced(
    name: str,
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """Decorates a coroutine function: each call in a span called ``name`` (tracing on)."""

    def decorate(
        function: Callable[P, Coroutine[Any, Any, R]],
    ) -> Callable[P, Coroutine[Any, Any, R]]:
        @functools.wraps(function)
        async def call(*args: P.args, **kwargs: P.kwargs) -> R:
            if _tracer is None:
                return await function(*args, **kwargs)
            with span(name):
                return await function(*args, **kwargs)

        return call

    return decorate


def record(name: str, seconds: float, attributes: Mapping[str, Any] | None = None) -> None:
    """A span of ``seconds`` that ended now, inside the current one."""
    if _tracer is None:
        return
    end = time.time_ns()
    started = _tracer.start_span(name, start_time=end - int(seconds * 1e9), attributes=attributes)
    started.end(end_time=end)


def failed(current: Any, code: str, message: str) -> None:
    """Marks ``current`` (a span from above, or None) as ended in error."""
    if current is None:
        return
    from opentelemetry.trace import Status, StatusCode

    current.set_attribute("rpc.grpc.status_code", code)
    current.set_status(Status(StatusCode.ERROR, message))


def headers() -> dict[str, str]:
    """The current trace context as W3C headers ({} when tracing is off or no span is on):
    what OpenTelemetry's propagator injects, formatted here (this runs for every call)."""
    if _tracer is None:
        return {}
    context = _otel.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    carried = {
        TRACEPARENT: format_traceparent(context.trace_id, context.span_id, context.trace_flags)
    }
    if context.trace_state:
        carried[TRACESTATE] = context.trace_state.to_header()
    return carried


def with_context(metadata: tuple[tuple[str, V], ...]) -> tuple[tuple[str, V | str], ...]:
    """``metadata`` with its trace context replaced by the current span's (unchanged when
    tracing is off: the caller's context then passes through as it came)."""
    if _tracer is None:
        return metadata
    return with_carried(metadata, headers())


def with_carried(
    metadata: tuple[tuple[str, V], ...], carried: Mapping[str, str]
) -> tuple[tuple[str, V | str], ...]:
    """``metadata`` with its trace context replaced by the one ``carried`` holds (W3C
    headers, as a message may carry them; other entries of ``carried`` left out)."""
    kept: tuple[tuple[str, V | str], ...] = tuple(
        (key, value) for key, value in metadata if key not in _CONTEXT_KEYS
    )
    return kept + tuple((key, value) for key, value in carried.items() if key in _CONTEXT_KEYS)
