"""What the tests on the testbed (``testbed``: hosts as network namespaces) share: the testbed
itself, refused where the machine cannot host one, and the engines' settings there."""

from __future__ import annotations

import pytest

from testbed import Testbed, TestbedUnavailable

# Each host's link, both ways.
RATE_MBIT = 200
# Engines share this machine: a small KV cache each, the tiny model's default, also for a
# server started on a saved copy of it (any other model's default is 1 GiB).
ENGINE_FLAGS = ("--kv-cache-gib", "0.125")
# Seconds a job on a host may take.
JOB_SECONDS = 300


def open_testbed() -> Testbed:
    """A testbed; skipped without root (a developer's machine), failed as root without the
    tools (scripts/setup.sh did not run)."""
    try:
        return Testbed()
    except TestbedUnavailable as unavailable:
        if "root" in str(unavailable):
            pytest.skip(str(unavailable))
        raise
