"""The memory processes hold, read cheaply, and its peak sampled from a process of its own.

``memory_of`` reads counters the kernel keeps (``/proc/PID/status``: a few microseconds a
read), where ``smaps_rollup`` walks every page (0.15 s of CPU for a server of a 1 GB model).

``PeakMemory`` samples it 20 times a second from a small process of its own
(``python -m scripts.process_memory PID...``), not a thread of the measured trainer, whose GIL
it would take 20 times a second: on two cores shared by three busy processes each such handoff
waits for the thread to be scheduled (the one run with a thread had in-band updates ~0.5 s
slower; the machine is noisy, so this is a precaution). Before that, a thread reading
``smaps_rollup`` ten times a second took ~0.8 s of a ~3.7 s update.
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_SECONDS = 0.05


def memory_of(pids: Sequence[int]) -> int:
    """Bytes the processes hold: each one's anonymous resident memory, plus the shared memory
    (``/dev/shm``, ``memfd``) of the one mapping most of it, counted once, as processes that
    share it (a server's tensor-parallel ranks mapping its checkpoint copy) hold it once. 0 for
    a process gone."""
    anonymous, shared = 0, 0
    for pid in pids:
        fields: dict[str, int] = {}
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/status") as status:
                for line in status:
                    if line.startswith(("RssAnon:", "RssShmem:")):
                        name, kib = line.split()[:2]
                        fields[name] = int(kib) * 1024
        anonymous += fields.get("RssAnon:", 0)
        shared = max(shared, fields.get("RssShmem:", 0))
    return anonymous + shared


class PeakMemory:
    """The peak ``memory_of`` the processes ``pids`` (their children are not followed: pass
    every process) while in use, sampled by a process of its own."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.peak = 0
        self._sampler: subprocess.Popen[str] | None = None

    def __enter__(self) -> PeakMemory:
        self._sampler = subprocess.Popen(
            [sys.executable, "-m", "scripts.process_memory", *map(str, self.pids)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._sampler.stdout is not None
        self._sampler.stdout.readline()  # "sampling": its first sample is taken
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._sampler is not None
        peak, _ = self._sampler.communicate("")  # its standard input closes: it answers
        self.peak = int(peak)


def _sample(pids: list[int]) -> None:
    peak = memory_of(pids)
    print("sampling", flush=True)
    while not select.select([sys.stdin], [], [], SAMPLE_SECONDS)[0]:
        peak = max(peak, memory_of(pids))
    print(max(peak, memory_of(pids)), flush=True)


if __name__ == "__main__":
    _sample([int(pid) for pid in sys.argv[1:]])
