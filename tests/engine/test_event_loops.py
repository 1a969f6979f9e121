"""``--event-loop``: the engine server's two loops (its gRPC calls', vLLM's engine client's) on
uvloop by default, as vLLM's own servers run, or on asyncio's; the router's flag the same."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import uvloop

from servers.common.event_loops import ASYNCIO, UVLOOP, new_event_loop
from servers.common.process import run_until_done
from servers.engine.options import EngineOptions, build_parser, options_from_args
from servers.engine.vllm_adapter.engine_loop import EngineLoop
from servers.router.options import build_parser as router_parser


def test_the_engine_server_runs_on_uvloop_unless_asked_for_asyncio() -> None:
    assert EngineOptions().event_loop == UVLOOP
    assert options_from_args(build_parser().parse_args([])).engine.event_loop == UVLOOP
    chosen = options_from_args(build_parser().parse_args(["--event-loop", "asyncio"]))
    assert chosen.engine.event_loop == ASYNCIO
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        build_parser().parse_args(["--event-loop", "trio"])
    assert router_parser().parse_args([]).event_loop == ASYNCIO  # measured even there
    with pytest.raises(ValueError, match="--event-loop 'trio'"):
        new_event_loop("trio")


def test_a_server_process_main_runs_on_the_loop_it_was_given() -> None:
    """``run_until_done`` (every ``serve`` process's main) on each kind: the loop its coroutine
    finds running is the kind asked for."""
    seen: list[asyncio.AbstractEventLoop] = []

    async def main() -> None:
        seen.append(asyncio.get_running_loop())

    for kind in (UVLOOP, ASYNCIO):
        loop = new_event_loop(kind)
        run_until_done(main(), loop)
        loop.close()
    asyncio.set_event_loop(None)
    assert isinstance(seen[0], uvloop.Loop)
    assert not isinstance(seen[1], uvloop.Loop) and isinstance(seen[1], asyncio.BaseEventLoop)


@pytest.mark.parametrize("consumer", [UVLOOP, ASYNCIO])
def test_the_engine_loop_on_uvloop_relays_calls_and_streams_to_either_kind(consumer: str) -> None:
    """The engine's own loop on uvloop, its consumer (the gRPC loop) on either kind: a call
    comes back, a stream's items arrive in order and whole, and leaving a stream early cancels
    its producer over there (vLLM then aborts the request)."""
    engine = EngineLoop(new_loop=lambda: new_event_loop(UVLOOP))
    try:

        async def main() -> None:
            async def where() -> bool:
                return isinstance(asyncio.get_running_loop(), uvloop.Loop)

            assert await engine.call(where())
            cancelled = asyncio.Event()
            here = asyncio.get_running_loop()

            async def tokens(count: int) -> AsyncIterator[int]:
                try:
                    for token in range(count):
                        yield token
                        await asyncio.sleep(0)
                    if count > 1000:
                        await asyncio.sleep(60)  # held until the consumer leaves
                except asyncio.CancelledError:
                    here.call_soon_threadsafe(cancelled.set)
                    raise

            got = [item async for item in engine.stream(lambda: tokens(500), lambda t: [t, -t])]
            assert got == [value for t in range(500) for value in (t, -t)]
            async for item in engine.stream(lambda: tokens(2000), lambda t: [t]):
                if item == 1999:
                    break
            await asyncio.wait_for(cancelled.wait(), timeout=30)

        loop = new_event_loop(consumer)
        run_until_done(main(), loop)
        loop.close()
    finally:
        engine.close()
        asyncio.set_event_loop(None)
