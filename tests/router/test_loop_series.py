"""The router's lock-free per-message series (``servers/router/loop_series.py``) export what
prometheus_client's own Counter and Histogram export for the same observations, sample for
sample (bar ``_created``, which they leave out)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from servers.router.loop_series import LoopCounterFamily, LoopHistogramFamily
from servers.router.metrics import ITL_BUCKETS

# On the bounds, between them, under the first and over the last.
VALUES = [0.0, 0.01, 0.0100001, 0.03, 0.075, 0.5, 1.0, 79.9, 80.0, 80.1, 1e6, 0.2, 0.2]


def samples(registry: CollectorRegistry) -> list[str]:
    lines = generate_latest(registry).decode().splitlines()
    return sorted(line for line in lines if line and "_created" not in line)


def test_a_histogram_exports_as_prometheus_clients_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogramFamily("itl_seconds", "gaps", ["worker"], ITL_BUCKETS, ours)
    reference = Histogram("itl_seconds", "gaps", ["worker"], buckets=ITL_BUCKETS, registry=theirs)
    for worker in ("a:1", "b:2"):
        for value in VALUES if worker == "a:1" else VALUES[:3]:
            loop.labels(worker).observe(value)
            reference.labels(worker).observe(value)
    assert samples(ours) == samples(theirs)
    assert any('le="+Inf"' in line and line.endswith(" 13.0") for line in samples(ours))


def test_a_counter_exports_as_prometheus_clients_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopCounterFamily("tokens", "tokens relayed", ["worker", "token_type"], ours)
    reference = Counter("tokens", "tokens relayed", ["worker", "token_type"], registry=theirs)
    for amount in (1, 3, 128):
        loop.labels("a:1", "output").inc(amount)
        reference.labels("a:1", "output").inc(amount)
    assert samples(ours) == samples(theirs)
    assert 'tokens_total{token_type="output",worker="a:1"} 132.0' in samples(ours)
