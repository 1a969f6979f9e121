"""The one rule by which every fleet grows and shrinks (``Fleet.scale``).

An added server starts, then joins the router (RouterAdmin AddBackend); it serves version 0
and placement keeps calls off it (it is behind) until the trainer's next update reaches it. A
removed server -- the newest first -- is drained at the router (no new calls; its in-flight
calls finish, up to the timeout; DrainBackend then removes it), is no longer supervised, and
only then is stopped, so its exit is never taken for a death. The fleets supply how one server
starts and stops; this module knows nothing of processes or Ray.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from servers.common.supervision import ServerSupervisor


def scale_fleet(
    count: int,
    servers: list[str],
    *,
    router: str,
    start: Callable[[int], str],
    stop: Callable[[int], None],
    resized: Callable[[list[str]], None],
    on_event: Callable[[str], None],
    before_removing: Callable[[int], None] = lambda index: None,
    supervision: ServerSupervisor | None,
    timeout: float,
) -> list[str]:
    """Grows or shrinks ``servers`` (their addresses, in order) to ``count``; returns them.
    ``start(index)`` starts server ``index`` and returns its address once it is ready;
    ``stop(index)`` stops it; ``resized(servers)`` records each change as it happens;
    ``before_removing(index)`` is told before server ``index`` is drained (warm standbys
    keep their number: ``standbys``)."""
    import grpc

    from skyrl_grpc.v1 import router_pb2, router_pb2_grpc

    if count < 1:
        raise ValueError(f"scale({count}): a fleet keeps at least one server")
    servers = list(servers)
    held = supervision.lock if supervision is not None else contextlib.nullcontext()
    with grpc.insecure_channel(router) as channel, held:
        admin = router_pb2_grpc.RouterAdminStub(channel)
        while len(servers) < count:
            index = len(servers)
            servers.append(start(index))
            admin.AddBackend(router_pb2.AddBackendRequest(address=servers[-1]), timeout=30)
            _resized(servers, resized, supervision)
            on_event(f"server {index} ({servers[-1]}) added")
        while len(servers) > count:
            index = len(servers) - 1
            before_removing(index)
            address = servers.pop()
            admin.DrainBackend(router_pb2.DrainBackendRequest(address=address), timeout=timeout)
            _resized(servers, resized, supervision)  # no longer watched: its stop is no death
            stop(index)
            on_event(f"server {index} ({address}) drained and removed")
    return servers


def _resized(
    servers: list[str], resized: Callable[[list[str]], None], supervision: ServerSupervisor | None
) -> None:
    resized(list(servers))
    if supervision is not None:
        supervision.resize(list(servers))
