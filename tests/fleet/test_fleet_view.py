"""The fleet page's memory of what happened (``FleetEvents``): a server's health changes become
events once each, in order, and only changes do."""

from __future__ import annotations

from servers.router.fleet_view import EVENTS_KEPT, FleetEvents


def kinds(events: FleetEvents) -> list[tuple[str, str]]:
    return [(e["kind"], e["server"]) for e in events.recent()]


def test_health_changes_are_events_once_each() -> None:
    events = FleetEvents()
    events.health("a:1", False, "unspecified")  # not seen healthy yet: nothing happened
    events.health("a:1", True, "healthy")
    events.health("a:1", True, "healthy")  # a status update, no change
    events.health("b:2", True, "healthy")
    events.health("a:1", False, "unhealthy")
    events.health("a:1", False, "unhealthy")
    events.health("a:1", True, "healthy")
    events.record("migration", "a:1", "a stream moved")
    events.removed("b:2")
    assert kinds(events) == [
        ("joined", "a:1"),
        ("joined", "b:2"),
        ("lost", "a:1"),
        ("back", "a:1"),
        ("migration", "a:1"),
        ("removed", "b:2"),
    ]
    assert events.recent()[2]["detail"] == "unhealthy"


def test_only_the_last_events_are_kept() -> None:
    events = FleetEvents()
    for index in range(EVENTS_KEPT + 5):
        events.record("migration", f"s:{index}")
    kept = events.recent()
    assert len(kept) == EVENTS_KEPT and kept[-1]["server"] == f"s:{EVENTS_KEPT + 4}"
