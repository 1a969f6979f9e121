"""A history of what a workload asked the fleet and what came back, and its checker (what the
fault tests assert, as Jepsen checks a history of operations rather than a final state).

A workload (``testbed.jobs``) records every call as a ``Call`` (each message's tokens with the
request's cumulative count and the weight version that made them, how it ended, where it
ran) and every weight update as an ``Update`` (the servers' versions after it); ``check``
reads a ``History`` and names every violation:

- ``lost`` / ``duplicated``: a message whose cumulative count runs ahead of the tokens
  received (tokens lost) or behind them (tokens sent twice), a call whose tokens differ from
  the undisturbed answer (``expected``: missing tokens or repeated ones), a request that ended
  with no result and no status its client retries, or a retried request counted twice;
- ``unfinished``: a call that ended OK without a finish reason;
- ``deadline``: a call that took longer than its deadline (a wedge or a hang);
- ``version``: a call whose tokens' weight versions go backwards, or an update after which the
  servers it reached serve different versions (all commit or none; the unreachable it named
  may lag);
- ``session``: a session's calls on another server while the first was reachable (``outages``:
  when each server could not be reached), unless it moves onto a server healed from an outage
  (the placement evening out the load the outage left) or onto new weights (no KV cache to
  keep across versions).

Everything is plain JSON-able values: a job prints its history, the test checks it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

# Statuses a client retries (the call had no result, and the client sends it again).
RETRYABLE = frozenset({"UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED"})


@dataclass
class Message:
    """One streamed message of a call."""

    tokens: list[int]
    # The request's output tokens so far, as the server counted them (Usage.completion_tokens).
    cumulative: int
    weight_version: int = 0


@dataclass
class Call:
    """One attempt at a request: ``key`` names the request (a retry keeps it)."""

    key: str
    started: float
    ended: float
    deadline: float  # seconds the caller allowed
    messages: list[Message] = field(default_factory=list)
    status: str = "OK"  # a gRPC status code's name
    finish_reason: str = ""  # "" when the call ended without one
    session: str = ""
    server: str = ""  # where it ran (the router's x-skyrl-backend), "" if unknown
    # When its first message came (0.0: unknown): ``server`` was settled by then, not at
    # ``started`` (a server lost before it answered had the call moved on).
    answered: float = 0.0
    expected: list[int] | None = None  # the undisturbed answer, where it is known

    @property
    def tokens(self) -> list[int]:
        return [token for message in self.messages for token in message.tokens]


@dataclass
class Update:
    """One weight update: whether it committed and what each server it reached serves after."""

    version: int
    committed: bool
    versions_after: dict[str, int]
    unreachable: list[str] = field(default_factory=list)  # servers the update named


@dataclass
class Outage:
    """A server that could not be reached from ``start`` to ``end`` (monotonic seconds)."""

    server: str
    start: float
    end: float


@dataclass
class History:
    calls: list[Call] = field(default_factory=list)
    updates: list[Update] = field(default_factory=list)
    outages: list[Outage] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> History:
        calls = [
            Call(**{**c, "messages": [Message(**m) for m in c["messages"]]})
            for c in data.get("calls", [])
        ]
        updates = [Update(**u) for u in data.get("updates", [])]
        outages = [Outage(**o) for o in data.get("outages", [])]
        return cls(calls, updates, outages)


@dataclass(frozen=True)
class Violation:
    kind: str  # lost, duplicated, unfinished, deadline, version, session
    what: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.what}"


def check(history: History) -> list[Violation]:
    """Every violation in ``history`` (empty: nothing lost, duplicated, late or split)."""
    found: list[Violation] = []
    for call in history.calls:
        found += _check_call(call)
    found += _check_results(history.calls)
    found += _check_sessions(history.calls, history.outages)
    for update in history.updates:
        found += _check_update(update)
    return found


def _check_call(call: Call) -> list[Violation]:
    found: list[Violation] = []
    name = f"call {call.key} on {call.server or '?'}"
    received = 0
    for index, message in enumerate(call.messages):
        received += len(message.tokens)
        if message.cumulative > received:
            found.append(
                Violation(
                    "lost",
                    f"{name}: message {index} counts {message.cumulative} tokens, "
                    f"{received} arrived",
                )
            )
            received = message.cumulative
        elif message.cumulative < received:
            found.append(
                Violation(
                    "duplicated",
                    f"{name}: message {index} counts {message.cumulative} tokens, "
                    f"{received} arrived",
                )
            )
            received = message.cumulative
    if call.status == "OK" and call.expected is not None and call.tokens != call.expected:
        got, want = call.tokens, call.expected
        kind = "duplicated" if len(got) > len(want) else "lost"
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        where = f"first difference at token {at}" if at is not None else "a prefix"
        found.append(
            Violation(kind, f"{name}: {len(got)} tokens, the undisturbed answer has "
                      f"{len(want)} ({where})")
        )  # fmt: skip
    if call.status == "OK" and not call.finish_reason:
        found.append(Violation("unfinished", f"{name}: ended OK without a finish reason"))
    if call.ended - call.started > call.deadline:
        found.append(
            Violation(
                "deadline",
                f"{name}: took {call.ended - call.started:.1f} s, its deadline {call.deadline} s",
            )
        )
    versions = [message.weight_version for message in call.messages if message.tokens]
    if any(later < earlier for earlier, later in pairwise(versions)):
        found.append(Violation("version", f"{name}: weight versions go backwards: {versions}"))
    return found


def _check_results(calls: list[Call]) -> list[Violation]:
    """Each request counted once: one OK attempt, or attempts that all ended retryably with
    the last one's status a caller sees (a request whose last attempt failed otherwise lost)."""
    attempts: dict[str, list[Call]] = defaultdict(list)
    for call in calls:
        attempts[call.key].append(call)
    found: list[Violation] = []
    for key, tries in attempts.items():
        ok = [c for c in tries if c.status == "OK"]
        if len(ok) > 1:
            found.append(Violation("duplicated", f"request {key}: {len(ok)} results counted"))
        failed = [c.status for c in tries if c.status != "OK" and c.status not in RETRYABLE]
        if not ok and failed:
            found.append(Violation("lost", f"request {key}: no result, ended {failed[-1]}"))
    return found


def _check_sessions(calls: list[Call], outages: list[Outage]) -> list[Violation]:
    """A session stays on its server unless that server was unreachable before it moved (by
    the time the call that moved was answered: a call sent before the outage began moves when
    its server is lost before answering), it moves onto a server healed from an outage
    (bounded-load placement evening out the load the outage left: every session it moved sits
    on the others; the call there shows it healed, also where the outage's recorded end came
    later: a restarted server is routable before whoever restarted it reads that it is ready),
    or the weights changed between its two calls (the KV cache a session is kept for never
    crosses weight versions, so a move then costs nothing: placement keeps calls off a server
    still behind the newest version)."""
    found: list[Violation] = []
    by_session: dict[str, list[Call]] = defaultdict(list)
    for call in calls:
        if call.session and call.server and call.status == "OK":
            by_session[call.session].append(call)
    for session, ordered in by_session.items():
        ordered.sort(key=lambda c: c.started)
        for before, after in pairwise(ordered):
            if after.server == before.server:
                continue
            # The move was made by the time its call was answered (a call sent to its server
            # before an outage began moves when the server is lost, before its first message).
            moved_by = after.answered or after.started
            unreachable = any(
                o.server == before.server and o.start <= moved_by and o.end >= before.started
                for o in outages
            )
            onto_healed = any(o.server == after.server and o.start <= moved_by for o in outages)
            new_weights = (
                bool(before.messages and after.messages)
                and after.messages[0].weight_version != before.messages[-1].weight_version
            )
            if not (unreachable or onto_healed or new_weights):
                found.append(
                    Violation(
                        "session",
                        f"session {session} moved {before.server} -> {after.server} while "
                        f"{before.server} was reachable",
                    )
                )
    return found


def _check_update(update: Update) -> list[Violation]:
    reached = {s: v for s, v in update.versions_after.items() if s not in update.unreachable}
    versions = set(reached.values())
    if len(versions) > 1:
        listed = ", ".join(f"{s}: {v}" for s, v in sorted(reached.items()))
        return [Violation("version", f"update {update.version} left versions split: {listed}")]
    if update.committed and versions and versions != {update.version}:
        return [
            Violation(
                "version",
                f"update {update.version} committed, the servers serve {sorted(versions)}",
            )
        ]
    if not update.committed and update.version in versions:
        return [Violation("version", f"update {update.version} rolled back, the servers serve it")]
    return []
