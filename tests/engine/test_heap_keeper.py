"""A weight-updating worker gives freed heap back once it has piled up past a slack, and not
after every update (each trim costs the next update its page faults)."""

from __future__ import annotations

from servers.engine.worker.heap import HeapKeeper, resident_bytes
from skyrl_grpc.host_memory import freed_memory_trim


class Process:
    """Resident memory as a test sets it; a trim drops it to what is in use."""

    def __init__(self, resident: int) -> None:
        self.resident = resident
        self.in_use = resident
        self.trims = 0

    def trim(self) -> None:
        self.trims += 1
        self.resident = self.in_use


def test_trims_only_past_the_slack_and_keeps_the_ceiling_above_memory_in_use() -> None:
    process = Process(resident=1000)
    keeper = HeapKeeper(slack=500, trim=process.trim, resident=lambda: process.resident)
    process.resident = 1500  # grown by exactly the slack: kept for reuse
    assert keeper.check() is False and process.trims == 0
    process.resident, process.in_use = 1800, 1100  # past it, mostly freed heap
    assert keeper.check() is True and process.resident == 1100
    assert keeper.ceiling == 1500  # the start's ceiling still stands
    process.resident, process.in_use = 1900, 1700  # past it again, most of it in use
    assert keeper.check() is True and process.resident == 1700
    assert keeper.ceiling == 1950  # raised: no trim after every update from here
    process.resident = 1900
    assert keeper.check() is False and keeper.trims == 2


def test_without_a_trim_it_never_trims() -> None:
    keeper = HeapKeeper(slack=0, trim=None, resident=iter([10, 10**12]).__next__)
    assert keeper.check() is False


def test_glibc_trim_runs_in_this_process() -> None:
    trim = freed_memory_trim()
    assert trim is not None  # this project's machines run glibc
    trim()
    assert resident_bytes() > 0
