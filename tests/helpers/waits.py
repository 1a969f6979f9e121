"""Waiting for real conditions instead of fixed sleeps."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from skyrl_grpc.v1 import control_plane_pb2 as cp

if TYPE_CHECKING:  # conftest imports this module: the client's imports stay out of its start
    from skyrl_grpc.v1 import control_plane_pb2_grpc
    from trainer_client import InferenceClient

# The most an engine server's start may take (vLLM's imports, the model, the warm-up) before a
# test fails: ~20 s alone on a quiet machine, but minutes on two shared cores when a test starts
# several servers beside the other test worker and other people's work (a loaded pass has seen
# five servers start at once, each getting a tenth of a core). Only reached when a start hangs.
ENGINE_START_SECONDS = 900.0
# pytest-timeout's limit (the suite's is 600 s) for a test that starts a fleet of server
# processes and restarts some of them: several engine starts in a row, each up to the above.
FLEET_TEST_TIMEOUT = 1800.0


async def running_on_engines(
    client: InferenceClient,
    count: int,
    pending: asyncio.Future[Any],
    servers: Sequence[str] | None = None,
) -> None:
    """Waits until the engines (``servers``, default all the client's) run ``count`` requests
    (a fixed sleep races the fast tiny model)."""

    async def running() -> int:
        loads = await client.server_loads()
        return sum(loads[s].running_requests for s in (servers or loads))

    while await running() < count:
        if pending.done():
            error = pending.exception()
            raise AssertionError(f"the requests ended before they were seen running: {error!r}")
        await asyncio.sleep(0.01)


async def until(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout: float = 60.0,
    what: str = "",
    interval: float = 0.01,
) -> None:
    """Waits until ``condition()`` (a function, or a coroutine function) holds, checked every
    ``interval`` seconds (10 ms; more for a check that opens connections); fails the test after
    ``timeout`` seconds, naming ``what`` it waited for. The bound
    is generous on purpose: it is only reached when the event never comes, and a shared, busy
    CI machine can take many times longer than a quiet one to get there."""

    async def holds() -> bool:
        result = condition()
        return await result if inspect.isawaitable(result) else bool(result)

    deadline = asyncio.get_running_loop().time() + timeout
    while not await holds():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        await asyncio.sleep(interval)


def wait_until(condition: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    """``until`` for code outside an event loop (a test driving processes, Ray): checks
    ``condition()`` every 50 ms; fails after ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(0.05)


async def engine_idle(control: control_plane_pb2_grpc.ControlPlaneAsyncStub) -> cp.GetLoadResponse:
    """Waits until no request runs or waits on the engine behind ``control``; its load then."""
    loads: list[cp.GetLoadResponse] = []

    async def idle() -> bool:
        loads.append(await control.GetLoad(cp.GetLoadRequest()))
        return loads[-1].running_requests == 0 and loads[-1].waiting_requests == 0

    await until(idle, what="the engine idle (no request running or waiting)")
    return loads[-1]


async def engines_idle(client: InferenceClient) -> bool:
    """No request runs or waits on any of the client's servers."""
    loads = await client.server_loads()
    return all(load.running_requests + load.waiting_requests == 0 for load in loads.values())


async def failing_while_paused(client: InferenceClient, failing: Awaitable[Any]) -> BaseException:
    """Runs ``failing`` (a batch with one bad part) while every server is paused (KEEP, so the
    good parts wait on the engines instead of finishing), returns its error, and checks that
    the good parts were aborted on the servers: the engines are idle before they resume."""
    await client.pause("keep")
    try:
        try:
            await failing
        except Exception as error:
            caught: BaseException = error
        else:
            raise AssertionError("the batch did not fail")
        await until(lambda: engines_idle(client), 10, "the batch's other parts aborted")
        return caught
    finally:
        await client.resume()
