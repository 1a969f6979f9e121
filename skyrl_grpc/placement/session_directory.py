"""Where each live session is: the directory a placement policy keeps.

Engine servers are the source of truth: each one tracks the sessions it serves (every request
with an ``x-session-id`` renews it; ``FinishSession`` or idleness ends it) and reports them in
its ``ServerStatus`` stream, whole on the first message and as changes after. Everyone who
places requests (router replicas, a router that restarted, trainer clients that route
themselves) follows those streams, so all of them see the same placements without sharing any
state of their own. A placement made here and not yet reported by its server is kept as
pending, so the next turn of a new session goes where its first went.

A session a placer moves (its server failed, or held too many) is remembered as moved away
from its old server until that server stops reporting it (the placer sends it FinishSession;
idleness ends it there otherwise): its stale reports, including a full resync after an outage,
do not pull the session back.

Every operation is O(1) in the number of sessions (except dropping a whole server), because
the router consults this on every call.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

# A session without a request for this long ends on its server (--session-idle-seconds);
# a placement made here, never confirmed by a server, counts as long. One number for both.
SESSION_IDLE_SECONDS = 600.0


class SessionDirectory:
    """Session id -> the server that holds it, from servers' reports and placements made here.

    ``pending_seconds``: how long a placement made here counts, from its last use, before its
    server reports the session (a server without ServerStatus never does).
    """

    def __init__(
        self,
        pending_seconds: float = SESSION_IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pending_seconds = pending_seconds
        self._clock = clock
        self._home: dict[str, str] = {}  # session -> its server (reported or pending)
        self._counts: Counter[str] = Counter()  # server -> sessions whose home it is
        # Sessions placed here and not yet reported, oldest use first.
        self._pending: OrderedDict[str, float] = OrderedDict()
        self._reported: dict[str, set[str]] = {}  # server -> the sessions it reports
        self._moved: dict[str, str] = {}  # session -> the server it moved away from

    # -- what servers report ------------------------------------------------------------------

    def report(
        self,
        address: str,
        added: Iterable[str],
        removed: Iterable[str] = (),
        complete: bool = False,
    ) -> None:
        """A server's sessions: ``complete`` means ``added`` lists all of them."""
        added = list(added)
        held = self._reported.setdefault(address, set())
        if complete:
            for session in held - set(added):
                self._drop_report(address, session)
            for session in [s for s, a in self._moved.items() if a == address]:
                if session not in added:
                    del self._moved[session]  # it no longer holds the session
        for session in removed:
            self._drop_report(address, session)
        for session in added:
            held.add(session)
            if self._moved.get(session) == address:
                continue  # a stale copy: the session lives elsewhere now
            self._pending.pop(session, None)
            self._assign(session, address)

    def _drop_report(self, address: str, session: str) -> None:
        """``address`` no longer holds ``session`` (finished or expired there)."""
        self._reported.get(address, set()).discard(session)
        if self._moved.get(session) == address:
            del self._moved[session]
        elif self._home.get(session) == address:
            self._unassign(session)

    def forget_server(self, address: str) -> None:
        """The server left the membership: its sessions are placed anew."""
        for session in self._reported.pop(address, set()):
            if self._home.get(session) == address:
                self._unassign(session)
        for session in [s for s, a in self._home.items() if a == address]:
            self._unassign(session)  # pending there
        for session in [s for s, a in self._moved.items() if a == address]:
            del self._moved[session]

    # -- placements made here -----------------------------------------------------------------

    def place(self, session: str, address: str) -> str | None:
        """``session`` goes to ``address`` from now; returns the server it moved away from, if
        it lived elsewhere."""
        previous = self._home.get(session)
        if previous == address:
            previous = None
        elif previous is not None and session in self._reported.get(previous, ()):
            self._moved[session] = previous
        self._assign(session, address)
        self._pending[session] = self._clock()
        self._pending.move_to_end(session)
        return previous

    def touch(self, session: str) -> None:
        """A call of ``session`` went out: a pending placement lives on."""
        if session in self._pending:
            self._pending[session] = self._clock()
            self._pending.move_to_end(session)

    def finish(self, session: str) -> None:
        """The session ended (FinishSession): forget it; its servers' reports of it are gone
        once they report it removed."""
        self._unassign(session)
        self._moved.pop(session, None)
        for held in self._reported.values():
            held.discard(session)

    # -- reading ------------------------------------------------------------------------------

    def home(self, session: str) -> str | None:
        """The server holding ``session``, or None if no one knows it."""
        self._expire()
        return self._home.get(session)

    def snapshot(self) -> dict[str, str]:
        """Every live session and the server holding it (a copy)."""
        self._expire()
        return dict(self._home)

    def live_sessions(self) -> Counter[str]:
        """Live sessions per server (reported, or placed here and pending)."""
        self._expire()
        return Counter(self._counts)

    def __len__(self) -> int:
        return len(self._home)

    # -- bookkeeping --------------------------------------------------------------------------

    def _assign(self, session: str, address: str) -> None:
        previous = self._home.get(session)
        if previous == address:
            return
        if previous is not None:
            self._decrement(previous)
        self._home[session] = address
        self._counts[address] += 1

    def _unassign(self, session: str) -> None:
        self._pending.pop(session, None)
        previous = self._home.pop(session, None)
        if previous is not None:
            self._decrement(previous)

    def _decrement(self, address: str) -> None:
        self._counts[address] -= 1
        if self._counts[address] <= 0:
            del self._counts[address]

    def _expire(self) -> None:
        """Pending placements unused for ``pending_seconds`` end (oldest first, so O(1) when
        none is due)."""
        oldest = self._clock() - self.pending_seconds
        while self._pending:
            session, used = next(iter(self._pending.items()))
            if used >= oldest:
                return
            self._unassign(session)
            self._moved.pop(session, None)
