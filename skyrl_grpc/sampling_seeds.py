"""Servers sampling with one seed, found the same way by the router and by a client routing
itself: vLLM draws a request without a seed of its own from the generator its server's
``--seed`` started, so two servers seeded alike and handed alike batches return alike samples
(a prompt's group spread over them gets duplicates). Each server reports its seed on its
``ServerStatus`` (``sampling_seed``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from skyrl_grpc.v1 import router_pb2, status_pb2

# What to do about it, said in every warning.
ADVICE = (
    "alike batches get alike samples; start each server with a --seed of its own "
    "(skyrl-grpc up does)"
)


def reported_seed(report: status_pb2.WatchResponse | router_pb2.Backend) -> int | None:
    """The seed a server's status (or the router's view of it) reports; None if none."""
    return report.sampling_seed if report.HasField("sampling_seed") else None


def shared_seeds(seeds: Mapping[str, int | None]) -> dict[int, tuple[str, ...]]:
    """Of ``seeds`` (each server's, None: unreported), the seeds two or more servers report,
    each with those servers' addresses, sorted."""
    by_seed: dict[int, list[str]] = defaultdict(list)
    for address, seed in seeds.items():
        if seed is not None:
            by_seed[seed].append(address)
    return {seed: tuple(sorted(a)) for seed, a in by_seed.items() if len(a) > 1}
