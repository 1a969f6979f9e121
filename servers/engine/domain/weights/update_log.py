"""The server's last weight updates with their phases, for those who watch the fleet.

The update transaction tells its phase observer each phase that ended well (``start``,
``transfer``: each stream or broadcast, ``commit``, ``rollback``); ``UpdateLog.phase`` is that
observer (beside the metrics'): phases gather into the update under way, a ``commit`` or
``rollback`` ends it as a record with the version serving then. The status stream
(``ServerStatus``) carries the last few, and the router's fleet page shows them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from servers.engine.domain.weights.transaction import PhaseObserver
from skyrl_grpc import tracing

# Records kept: enough for a page to show what the last updates looked like.
KEPT = 5


@dataclass
class UpdateRecord:
    """One update that ended: the version serving after it, how it ended ("committed" or
    "rolled_back"), each phase's seconds (transfers summed), the bytes staged, when it ended."""

    weight_version: int
    outcome: str
    phase_seconds: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    ended_at: float = 0.0


class UpdateLog:
    """The last ``KEPT`` updates; ``version()``: the version serving now; ``ended()``: told
    when a record is added (the status announces it); ``then``: a further observer."""

    def __init__(
        self,
        version: Callable[[], int],
        ended: Callable[[], None],
        then: PhaseObserver | None = None,
    ) -> None:
        self._version = version
        self._ended = ended
        self._then = then
        self._current = UpdateRecord(0, "")
        self._records: deque[UpdateRecord] = deque(maxlen=KEPT)

    def phase(self, name: str, seconds: float, nbytes: int) -> None:
        # A span of the phase, inside the call that ran it (when tracing is on).
        tracing.record(f"weight_update.{name}", seconds, {"skyrl.bytes": nbytes})
        if name == "start":
            self._current = UpdateRecord(0, "")
        current = self._current
        current.phase_seconds[name] = current.phase_seconds.get(name, 0.0) + seconds
        current.bytes += nbytes
        if name in ("commit", "rollback"):
            current.weight_version = self._version()
            current.outcome = "committed" if name == "commit" else "rolled_back"
            current.ended_at = time.time()
            self._records.append(current)
            self._current = UpdateRecord(0, "")
            self._ended()
        if self._then is not None:
            self._then(name, seconds, nbytes)

    def records(self) -> tuple[UpdateRecord, ...]:
        """The kept records, oldest first."""
        return tuple(self._records)
