"""The callers' request ids in flight on the engine: one request per id at a time.

An abort frees its ids at once, not when each request's stream ends: a stream whose caller was
cut off (a router that lost this server to a partition) ends only once its connection is found
dead, and the caller sending the request again here, under the same id, must not wait for that.
vLLM tells requests apart by ids of its own, so the id may name the next request at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from skyrl_grpc.errors import AlreadyExists


class InFlightIds:
    """``take`` when a request is taken in, ``finished`` when it ends, ``aborted`` when an
    abort reached vLLM."""

    def __init__(self) -> None:
        self._running: set[str] = set()
        # Ids freed by an abort whose requests have not ended yet (each one's ``finished`` to
        # come).
        self._aborted_unfinished: Counter[str] = Counter()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._running

    def __len__(self) -> int:
        return len(self._running)

    def take(self, request_id: str) -> None:
        """ALREADY_EXISTS if ``request_id`` runs."""
        if request_id in self._running:
            raise AlreadyExists(
                f"request_id {request_id!r} is already in flight: use a unique id, or leave it "
                "empty for the server to assign one"
            )
        self._running.add(request_id)

    def finished(self, request_id: str) -> None:
        if self._aborted_unfinished[request_id] > 0:
            # An aborted request ending late: its id may name another request now. (Where
            # that other one ends first, its end is taken for the aborted one's, and the id
            # reads in flight until the aborted one ends too.)
            self._aborted_unfinished[request_id] -= 1
            if not self._aborted_unfinished[request_id]:
                del self._aborted_unfinished[request_id]
            return
        self._running.discard(request_id)

    def aborted(self, request_ids: Iterable[str]) -> None:
        """Frees the ids of requests vLLM has aborted, whose ends are still to come."""
        for request_id in request_ids:
            if request_id in self._running:
                self._running.discard(request_id)
                self._aborted_unfinished[request_id] += 1
