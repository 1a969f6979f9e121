"""The warm-standby rule (``servers.fleet.standbys``) on plain callables: which standby takes a
dead server's place (healthy and not behind), when none does, how a shrinking fleet keeps its
standbys; and the supervisor telling the fleet of a death before it restarts the server."""

from __future__ import annotations

import pytest

from servers.common.supervision import RestartPolicy, ServerSupervisor
from servers.fleet.standbys import StandbyRoles
from skyrl_grpc.v1 import router_pb2

HEALTHY = router_pb2.BACKEND_STATE_HEALTHY
UNHEALTHY = router_pb2.BACKEND_STATE_UNHEALTHY
ADDRESSES = ["h:0", "h:1", "h:2", "h:3"]


def members(states: dict[str, tuple[router_pb2.BackendState, int]]) -> list[router_pb2.Backend]:
    """Backends as the router lists them, from address -> (state, weight version)."""
    return [
        router_pb2.Backend(address=a, state=state, weight_version=version)
        for a, (state, version) in states.items()
    ]


def test_a_healthy_current_standby_takes_a_dead_servers_place_and_the_dead_one_becomes_one() -> (
    None
):
    roles = StandbyRoles.last(2, 4)  # servers 0, 1 serve; 2, 3 stand by
    told: list[tuple[str, bool]] = []
    listed = members(
        {
            "h:0": (UNHEALTHY, 5),  # the dead one
            "h:1": (HEALTHY, 5),
            "h:2": (HEALTHY, 4),  # behind: it missed an update
            "h:3": (HEALTHY, 5),
        }
    )
    promoted = roles.promote_in_place_of(
        0, ADDRESSES, lambda: listed, lambda a, s: told.append((a, s))
    )
    assert promoted == 3
    assert told == [("h:3", False), ("h:0", True)]  # promoted first: never a gap in serving
    assert roles.indexes == {0, 2}
    assert roles.of(ADDRESSES) == ("h:0", "h:2")


def test_a_promotion_the_router_made_first_is_taken_as_it_is() -> None:
    roles = StandbyRoles.last(1, 3)  # 0, 1 serve; 2 stands by
    listed = [
        router_pb2.Backend(address="h:0", state=UNHEALTHY, standby=True),
        router_pb2.Backend(address="h:1", state=HEALTHY),
        router_pb2.Backend(address="h:2", state=HEALTHY),  # serving now
    ]
    told: list[tuple[str, bool]] = []
    promoted = roles.promote_in_place_of(
        0, ADDRESSES[:3], lambda: listed, lambda a, s: told.append((a, s))
    )
    assert promoted == 2 and roles.indexes == {0} and told == []


@pytest.mark.parametrize(
    "dead, standby_state",
    [
        (3, (HEALTHY, 5)),  # a standby died: nothing to promote, it restarts as a standby
        (0, (UNHEALTHY, 5)),  # the standby is down too
        (0, (HEALTHY, 4)),  # the standby is behind the fleet's version
    ],
)
def test_no_standby_is_promoted_unless_one_is_ready(
    dead: int, standby_state: tuple[router_pb2.BackendState, int]
) -> None:
    roles = StandbyRoles.last(1, 4)
    told: list[tuple[str, bool]] = []
    states = {"h:0": (UNHEALTHY, 5), "h:1": (HEALTHY, 5), "h:2": (HEALTHY, 5), "h:3": standby_state}
    promoted = roles.promote_in_place_of(
        dead, ADDRESSES, lambda: members(states), lambda a, s: told.append((a, s))
    )
    assert promoted is None and told == [] and roles.indexes == {3}


def test_a_shrinking_fleet_keeps_its_standbys_by_making_its_newest_serving_server_one() -> None:
    roles = StandbyRoles.last(1, 3)  # 0, 1 serve; 2 stands by
    told: list[tuple[str, bool]] = []
    roles.before_removing(2, ADDRESSES[:3], lambda a, s: told.append((a, s)))
    assert told == [("h:1", True)] and roles.indexes == {1}
    roles.before_removing(0, ADDRESSES[:3], lambda a, s: told.append((a, s)))
    assert told == [("h:1", True)]  # removing a serving server changes no role
    with pytest.raises(ValueError, match="at least one serving"):
        roles.before_removing(1, ADDRESSES[:2], lambda a, s: None)
    with pytest.raises(ValueError, match="at least one must serve"):
        StandbyRoles.last(2, 2)


def test_the_supervisor_tells_of_a_death_before_it_waits_out_the_backoff() -> None:
    order: list[str] = []
    dead = {0: "exit code -9"}

    def restart(index: int) -> str:
        order.append(f"restart {index}")
        dead.pop(index)
        return "h:0"

    def sleep(seconds: float) -> bool:
        order.append(f"sleep {seconds:g}")
        return False  # not closing

    supervisor = ServerSupervisor(
        2,
        death=dead.get,
        restart=restart,
        on_event=lambda line: None,
        policy=RestartPolicy(first_delay=1.0),
        on_death=lambda index, cause: order.append(f"death {index}: {cause}"),
        addresses=ADDRESSES[:2],
        sleep=sleep,
    )
    supervisor.check_once()
    assert order == ["death 0: exit code -9", "sleep 1", "restart 0"]
