"""The router's routing feed (WatchBackends) as a plain class: one computation per change,
shared by every watcher; a late watcher starts complete; one that falls behind is resent the
whole view."""

from __future__ import annotations

from servers.router import feed as feed_module
from servers.router.feed import RoutingFeed
from skyrl_grpc.placement import BoundedLoadPolicy
from skyrl_grpc.v1 import router_pb2

HEALTHY = router_pb2.BACKEND_STATE_HEALTHY


def mirror(view: dict[str, str], update: router_pb2.WatchBackendsResponse) -> dict[str, str]:
    """What a client following the feed holds after ``update``."""
    if update.complete:
        view = {}
    for session in update.sessions_removed:
        view.pop(session, None)
    for placed in update.sessions_added:
        view[placed.session_id] = placed.address
    return view


async def test_watchers_share_each_change_and_a_late_one_starts_complete() -> None:
    backends = [router_pb2.Backend(address=a, state=HEALTHY) for a in ("a:1", "b:1")]
    policy = BoundedLoadPolicy()
    feed = RoutingFeed(lambda: list(backends), policy, interval=3600)  # ticks by hand
    policy.sessions.place("s1", "a:1")
    first = feed.watch()
    second = feed.watch()
    views = [mirror({}, await anext(first)), mirror({}, await anext(second))]
    assert views == [{"s1": "a:1"}, {"s1": "a:1"}]
    assert feed.publish() is None  # nothing changed: nothing sent
    policy.sessions.place("s2", "b:1")
    policy.sessions.finish("s1")
    update = feed.publish()
    assert update is not None and not update.complete
    assert [p.session_id for p in update.sessions_added] == ["s2"]
    assert list(update.sessions_removed) == ["s1"]
    views = [mirror(views[0], await anext(first)), mirror(views[1], await anext(second))]
    assert views == [policy.sessions.snapshot()] * 2
    backends[1].state = router_pb2.BACKEND_STATE_UNHEALTHY  # a routing field changed
    health = feed.publish()
    assert health is not None and [b.state for b in health.backends][1] != HEALTHY
    late = feed.watch()
    joined = await anext(late)
    assert joined.complete and mirror({}, joined) == {"s2": "b:1"}
    for watcher in (first, second, late):
        await watcher.aclose()


async def test_a_watcher_that_falls_behind_gets_the_whole_view_again(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(feed_module, "QUEUE_LIMIT", 2)
    policy = BoundedLoadPolicy()
    feed = RoutingFeed(lambda: [router_pb2.Backend(address="a:1", state=HEALTHY)], policy, 3600)
    slow = feed.watch()
    assert (await anext(slow)).complete
    for i in range(5):  # more changes than its queue holds, none read
        policy.sessions.place(f"s{i}", "a:1")
        feed.publish()
    resent = await anext(slow)
    assert resent.complete and mirror({}, resent) == policy.sessions.snapshot()
    await slow.aclose()
