"""The fleets' one supervision rule (``servers.common.supervision``) on plain callables: restarts
with doubling backoff, the backoff reset after a server stayed up, a crash loop reported with its
cause and left down, and a server that comes back elsewhere reported as moved."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from servers.common.supervision import RestartPolicy, ServerSupervisor


class World:
    """Two servers whose deaths and restarts the test scripts; a fake clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.dead: dict[int, str] = {}
        self.restart_fails: list[str] = []  # the next restarts raise these
        self.events: list[str] = []
        self.slept: list[float] = []
        self.moves: list[tuple[int, str, str]] = []
        self.new_address: dict[int, str] = {}

    def death(self, index: int) -> str | None:
        return self.dead.get(index)

    def restart(self, index: int) -> str:
        if self.restart_fails:
            raise RuntimeError(self.restart_fails.pop(0))
        self.dead.pop(index, None)
        return self.new_address.get(index, f"10.0.0.{index}:1")

    def sleep(self, seconds: float) -> bool:
        self.slept.append(seconds)
        self.now += seconds
        return False

    def supervisor(self, **policy: float) -> ServerSupervisor:
        return ServerSupervisor(
            2,
            death=self.death,
            restart=self.restart,
            on_event=self.events.append,
            policy=RestartPolicy(**policy),  # type: ignore[arg-type]
            on_moved=lambda i, old, new: self.moves.append((i, old, new)),
            addresses=["10.0.0.0:1", "10.0.0.1:1"],
            clock=lambda: self.now,
            sleep=self.sleep,
        )


def test_a_dead_server_is_restarted_with_doubling_backoff_reset_after_staying_up() -> None:
    world = World()
    supervisor = world.supervisor(first_delay=1, max_delay=4, reset_after=60, max_failures=10)
    supervisor.check_once()
    assert world.events == []  # both alive: nothing to do
    for _ in range(4):  # dies right after each restart
        world.dead[1] = "exit code 1"
        supervisor.check_once()
    assert world.slept == [1, 2, 4, 4]  # doubled, capped
    assert supervisor.restarts == [0, 4]
    assert "server 1 (10.0.0.1:1) died (exit code 1); restarting in 1 s" in world.events
    assert world.events[-1].startswith("server 1 (10.0.0.1:1) is back")
    world.now += 61  # it stayed up: the next death starts from the first delay again
    world.dead[1] = "exit code 9"
    supervisor.check_once()
    assert world.slept[-1] == 1


def test_a_server_that_keeps_failing_is_reported_with_its_cause_and_left_down() -> None:
    world = World()
    supervisor = world.supervisor(first_delay=1, max_delay=30, reset_after=60, max_failures=3)
    world.dead[0] = "exit code 1: the engine failed to start: out of memory"
    world.restart_fails = ["server-0 did not become ready: out of memory"] * 5
    supervisor.check_once()
    assert supervisor.restarts == [3, 0]
    assert supervisor.given_up == {
        0: "the restart failed: server-0 did not become ready: out of memory"
    }
    assert "failed 3 times in a row" in world.events[-1]
    assert "out of memory" in world.events[-1]
    supervisor.check_once()  # left down: no more tries
    assert supervisor.restarts == [3, 0]


def test_a_server_back_at_another_address_is_reported_as_moved() -> None:
    world = World()
    supervisor = world.supervisor(first_delay=0)
    world.dead[0] = "the actor died: node 3 left the cluster"
    world.new_address[0] = "10.0.0.7:1"
    supervisor.check_once()
    assert world.moves == [(0, "10.0.0.0:1", "10.0.0.7:1")]
    assert supervisor.addresses == ["10.0.0.7:1", "10.0.0.1:1"]


class _Actor:
    """A Ray actor handle whose every method's call gives a token ``ray.get`` is patched on."""

    def __getattr__(self, name: str) -> Any:
        return SimpleNamespace(remote=lambda: name)


def test_a_ray_actor_out_of_reach_for_now_is_not_taken_for_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray's ActorUnavailableError is a RayActorError but means "try again later": a fleet that
    took it for a death would kill and restart a live router or server. Only ActorDiedError is
    a death."""
    import ray

    from servers.fleet.ray_group import RayFleet

    fleet = RayFleet(1)
    fleet._router, fleet._servers = _Actor(), [_Actor()]
    answers: list[Exception] = []

    def get(ref: Any, timeout: float | None = None) -> Any:
        raise answers[0]

    monkeypatch.setattr(ray, "get", get)
    for passing in (
        ray.exceptions.ActorUnavailableError("the node is slow to answer", None),
        ray.exceptions.GetTimeoutError("busy"),
    ):
        answers[:] = [passing]
        assert fleet._router_death() is None
        assert fleet._death(0) is None
    answers[:] = [ray.exceptions.ActorDiedError()]
    router_death, server_death = fleet._router_death(), fleet._death(0)
    assert router_death is not None and router_death.startswith("its actor died")
    assert server_death is not None and server_death.startswith("its actor died")
