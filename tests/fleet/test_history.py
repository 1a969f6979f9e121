"""The fault tests' history checker (``testbed.history``) catches what it is for: each broken
history below is one a fleet could produce (a token lost or sent twice across a migration, a
request counted twice, an update that split the fleet), and a clean one passes."""

from __future__ import annotations

import pytest

from testbed.history import Call, History, Message, Outage, Update, check

ANSWER = [5, 6, 7, 8, 9, 10]


def stream(key: str = "r1", **changes: object) -> Call:
    """A clean greedy stream of ANSWER in three messages, 0.5 s of its 5 s deadline."""
    fields: dict[str, object] = dict(
        key=key,
        started=10.0,
        ended=10.5,
        deadline=5.0,
        messages=[Message([5, 6], 2, 1), Message([7, 8], 4, 1), Message([9, 10], 6, 1)],
        finish_reason="length",
        session="s1",
        server="a",
        expected=ANSWER,
    )
    fields.update(changes)
    return Call(**fields)  # type: ignore[arg-type]


def kinds(history: History) -> list[str]:
    return [violation.kind for violation in check(history)]


def test_a_clean_history_passes_and_survives_its_json() -> None:
    history = History(
        [stream(), stream("r2", started=11.0, ended=11.4)],
        [Update(2, True, {"a": 2, "b": 2})],
    )
    assert check(History.from_json(history.to_json())) == []


def test_a_token_lost_across_a_migration_is_caught() -> None:
    # The continuation's first message counts 5 tokens: one never arrived.
    lost = stream(messages=[Message([5, 6], 2, 1), Message([8], 4, 1), Message([9, 10], 6, 1)])
    assert kinds(History([lost])) == ["lost", "lost"]  # by its count, and against the answer


def test_a_token_sent_twice_is_caught() -> None:
    twice = stream(
        messages=[Message([5, 6], 2, 1), Message([6, 7, 8], 4, 1), Message([9, 10], 6, 1)]
    )
    assert kinds(History([twice])) == ["duplicated", "duplicated"]


def test_a_request_counted_twice_is_caught_and_a_retry_after_unavailable_is_not() -> None:
    retried = [stream(status="UNAVAILABLE", messages=[], finish_reason=""), stream()]
    assert check(History(retried)) == []
    assert kinds(History([stream(), stream()])) == ["duplicated"]


def test_a_request_that_failed_for_good_is_lost() -> None:
    failed = stream(status="INTERNAL", messages=[], finish_reason="")
    assert kinds(History([failed])) == ["lost"]


def test_a_call_past_its_deadline_and_one_without_a_finish_reason_are_caught() -> None:
    assert kinds(History([stream(ended=16.0)])) == ["deadline"]
    assert kinds(History([stream(finish_reason="")])) == ["unfinished"]


@pytest.mark.parametrize(
    ("update", "split"),
    [
        (Update(3, True, {"a": 3, "b": 2}), True),  # committed on one, not the other
        (Update(3, True, {"a": 3, "b": 3}), False),
        (Update(3, False, {"a": 2, "b": 2}), False),  # rolled back everywhere
        (Update(3, False, {"a": 3, "b": 3}), True),  # "rolled back", yet serving it
        (Update(3, True, {"a": 3, "b": 2}, unreachable=["b"]), False),  # b named: catches up
    ],
)
def test_a_split_version_is_caught(update: Update, split: bool) -> None:
    assert kinds(History(updates=[update])) == (["version"] if split else [])


def test_versions_going_backwards_within_a_stream_are_caught() -> None:
    back = stream(messages=[Message([5, 6], 2, 2), Message([7, 8], 4, 1), Message([9, 10], 6, 2)])
    assert kinds(History([back])) == ["version"]


def test_a_session_moves_only_off_a_server_that_was_unreachable() -> None:
    first, moved = stream("r1"), stream("r2", started=12.0, ended=12.5, server="b")
    assert kinds(History([first, moved])) == ["session"]
    cut = Outage("a", 10.8, 14.0)
    assert check(History([first, moved], outages=[cut])) == []
    # Onto the healed server (the placement evening out the load); never to a third one.
    back = stream("r3", started=15.0, ended=15.5, server="a")
    assert check(History([first, moved, back], outages=[cut])) == []
    third = stream("r3", started=15.0, ended=15.5, server="c")
    assert kinds(History([first, moved, third], outages=[cut])) == ["session"]
    on_b = [stream("r1", server="b"), stream("r2", started=15.0, ended=15.5, server="a")]
    assert check(History(on_b, outages=[cut])) == []  # b's sessions even out onto healed a
    # Its call there shows a healed, also before the outage's recorded end (a restarted
    # server is routable before whoever restarted it reads that it is ready).
    late = Outage("a", 10.8, 16.0)
    assert check(History(on_b, outages=[late])) == []
    # Not onto a server whose outage began after the move (nothing healed there yet).
    assert kinds(History(on_b, outages=[Outage("a", 15.2, 16.0)])) == ["session"]
    # A call sent to its server before the outage began, which moved when it was lost before
    # answering: the move is judged when the call was answered, not when it was sent.
    sent_before = stream("r2", started=10.6, ended=14.5, server="b", answered=12.0)
    assert check(History([first, sent_before], outages=[cut])) == []
    answered_before = stream("r2", started=10.6, ended=14.5, server="b", answered=10.7)
    assert kinds(History([first, answered_before], outages=[cut])) == ["session"]


def test_a_session_may_move_when_the_weights_changed_between_its_calls() -> None:
    """A session is kept on its server for its KV cache, which a new weight version voids: a
    move across a version change is no violation; at the same version it still is."""
    newer = [Message([5, 6], 2, 2), Message([7, 8], 4, 2), Message([9, 10], 6, 2)]
    moved = stream("r2", started=12.0, ended=12.5, server="b", messages=newer)
    assert check(History([stream("r1"), moved])) == []
    same = stream("r2", started=12.0, ended=12.5, server="b")
    assert kinds(History([stream("r1"), same])) == ["session"]
