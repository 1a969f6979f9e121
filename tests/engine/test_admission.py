"""Admission control (``servers.engine.domain.admission``): samples run up to a limit, requests wait
in order up to a bound, beyond it they are refused; cancelled waiters free their place."""

from __future__ import annotations

import asyncio

import pytest

from servers.engine.domain.admission import Admission
from skyrl_grpc.errors import ResourceExhausted


async def test_requests_beyond_the_limit_wait_in_order_then_beyond_the_queue_are_refused() -> None:
    admission = Admission(max_running=4, max_queued=2)
    order: list[str] = []
    release = asyncio.Event()

    async def request(name: str, weight: int) -> None:
        async with admission.admit(weight):
            order.append(name)
            await release.wait()

    first = asyncio.ensure_future(request("a", 3))
    await asyncio.sleep(0)
    assert admission.running == 3
    waiting = [asyncio.ensure_future(request(n, w)) for n, w in (("b", 2), ("c", 1))]
    await asyncio.sleep(0)
    # c (weight 1) would fit, but b arrived first: c waits its turn (no starving b).
    assert order == ["a"] and admission.queued == 2
    with pytest.raises(ResourceExhausted, match="--max-queued-requests"):
        async with admission.admit(1):
            pass
    release.set()
    await asyncio.gather(first, *waiting)
    assert order == ["a", "b", "c"] and admission.running == 0 and admission.queued == 0


async def test_a_cancelled_waiter_gives_up_its_place() -> None:
    admission = Admission(max_running=1, max_queued=4)
    holder_release = asyncio.Event()

    async def hold() -> None:
        async with admission.admit(1):
            await holder_release.wait()

    holder = asyncio.ensure_future(hold())
    await asyncio.sleep(0)
    gone = asyncio.ensure_future(hold())
    await asyncio.sleep(0)
    assert admission.queued == 1
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert admission.queued == 0
    holder_release.set()
    await holder
    assert admission.running == 0


async def test_a_request_larger_than_the_limit_runs_alone() -> None:
    admission = Admission(max_running=4, max_queued=1)
    async with admission.admit(10):
        assert admission.running == 4
    assert admission.running == 0
