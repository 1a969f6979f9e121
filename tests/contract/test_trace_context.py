"""The W3C trace context this stack parses and formats itself on every traced call
(``skyrl_grpc.tracing``) agrees with OpenTelemetry's own propagator, header by header: the
same ids and flags for what it accepts, and the same refusals."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from skyrl_grpc.tracing import format_traceparent, parse_traceparent

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
HEADERS = [
    f"00-{TRACE}-{SPAN}-01",  # sampled
    f"00-{TRACE}-{SPAN}-00",  # not sampled
    f"  00-{TRACE}-{SPAN}-01 \t",  # surrounding blanks
    f"01-{TRACE}-{SPAN}-01-later-fields",  # a later version may add fields
    f"00-{TRACE}-{SPAN}-01-extra",  # version 00 may not
    f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
    f"00-{'0' * 32}-{SPAN}-01",  # zero trace id
    f"00-{TRACE}-{'0' * 16}-01",  # zero span id
    f"00-{TRACE.upper()}-{SPAN}-01",  # upper-case hex
    f"00-0x{TRACE[2:]}-{SPAN}-01",  # what int(..., 16) alone would take
    f"00-{TRACE[:-1]}-{SPAN}-01",  # short trace id
    f"00-{TRACE}-{SPAN}-1",  # short flags
    f"00_{TRACE}_{SPAN}_01",
    "",
    f"00-{TRACE}-{SPAN}-01" + " " * 600,  # over the propagator's 512 characters
]


def reference(header: str) -> tuple[int, int, int] | None:
    context = TraceContextTextMapPropagator().extract({"traceparent": header})
    span_context = trace.get_current_span(context).get_span_context()
    if not span_context.is_valid:
        return None
    return span_context.trace_id, span_context.span_id, int(span_context.trace_flags)


@pytest.mark.parametrize("header", HEADERS)
def test_parsing_agrees_with_the_propagator(header: str) -> None:
    assert parse_traceparent(header) == reference(header)


def test_the_header_cases_include_accepted_and_refused_ones() -> None:
    outcomes = [reference(h) is None for h in HEADERS]
    assert True in outcomes and False in outcomes


@pytest.mark.parametrize("flags", [0, 1])
def test_formatting_is_what_the_propagator_injects(flags: int) -> None:
    span_context = trace.SpanContext(
        int(TRACE, 16), int(SPAN, 16), is_remote=False, trace_flags=trace.TraceFlags(flags)
    )
    carrier: dict[str, str] = {}
    context = trace.set_span_in_context(trace.NonRecordingSpan(span_context))
    TraceContextTextMapPropagator().inject(carrier, context)
    assert format_traceparent(int(TRACE, 16), int(SPAN, 16), flags) == carrier["traceparent"]
    assert parse_traceparent(carrier["traceparent"]) == (int(TRACE, 16), int(SPAN, 16), flags)


def test_a_carried_context_replaces_the_calls_and_nothing_else() -> None:
    """``with_carried``: what a multiplexed request's message carries (``trace_context``) in
    place of its call's trace context; the call's other metadata kept, other keys of the
    carried map left out."""
    from skyrl_grpc.tracing import with_carried

    call = (("authorization", "Bearer t"), ("traceparent", HEADERS[0]), ("tracestate", "a=1"))
    carried = {"traceparent": HEADERS[1], "x-other": "no"}
    assert with_carried(call, carried) == (
        ("authorization", "Bearer t"),
        ("traceparent", HEADERS[1]),
    )
