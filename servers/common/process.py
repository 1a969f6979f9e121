"""What every process entry point shares: logging setup, the JSON lifecycle lines on stdout,
and running a server until a signal asks it to stop. Free of vLLM imports."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol


def configure_logging(level: int = logging.INFO) -> None:
    """Logs go to stderr: stdout carries only the lifecycle lines launchers read."""
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def announce(event: str, **fields: object) -> None:
    """One JSON line on stdout per lifecycle event (listening, ready, failed, stopped), for
    launchers and tests to read. A launcher that is gone (it exited, or was killed) is not the
    server's failure: its line is dropped, and so is every later one."""
    try:
        print(json.dumps({"event": event, **fields}), flush=True)
    except BrokenPipeError:
        # Later lines, and the interpreter's flush at exit, go nowhere instead of failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def read_announcement(line: str) -> dict[str, Any] | None:
    """The lifecycle event a line of a server's stdout announces, or None for any other line
    (the one reader of what ``announce`` writes: launchers and tests use it)."""
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "event" in event else None


def on_stop_signals(stop: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """Runs ``stop()`` once on the first SIGTERM or SIGINT of this event loop's process.

    Returns a function that removes the handlers. The stop task is kept referenced until it
    ends (a bare ``ensure_future`` may be collected mid-drain).
    """
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    def handle() -> None:
        if tasks:
            return  # already stopping

        async def run() -> None:
            await stop()

        task = loop.create_task(run())
        tasks.add(task)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle)

    def remove() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    return remove


class Serving(Protocol):
    """What a server process runs: started, maybe ready later, stopped by a signal."""

    @property
    def address(self) -> str: ...

    async def start(self) -> None: ...

    async def wait_ready(self) -> object: ...

    async def wait_stopped(self) -> None: ...


async def serve_until_stopped(
    server: Serving,
    stop: Callable[[], Awaitable[None]],
    describe: Callable[[], dict[str, object]] = dict,
) -> None:
    """Starts ``server``, announces ``listening`` (with the fields ``describe()`` gives once it
    has started), then ``ready`` (or ``failed``, re-raising), and runs until ``stop()``, which
    SIGTERM or SIGINT calls, has stopped it, then announces ``stopped``. A stop that comes
    before the server is ready ends its start (``wait_ready`` is cancelled) and stops it."""
    await server.start()
    stopping = asyncio.Event()

    async def stop_once_asked() -> None:
        stopping.set()
        await stop()

    # Before "listening": a launcher may stop the server as soon as it reads that line.
    on_stop_signals(stop_once_asked)
    announce("listening", address=server.address, **describe())
    try:
        await server.wait_ready()
    except asyncio.CancelledError:
        if not stopping.is_set():
            raise
    except Exception as error:
        announce("failed", address=server.address, error=str(error))
        raise
    else:
        announce("ready", address=server.address)
    await server.wait_stopped()
    announce("stopped", address=server.address)


def run_until_done(main: Awaitable[None], loop: asyncio.AbstractEventLoop | None = None) -> None:
    """``asyncio.run(main)`` without its last step, waiting for the loop's worker threads: a
    server stopped while its engine's modules still import in one (seconds, more on a busy
    host) would otherwise stay up until the import finished. For a process that ends with
    ``exit_now`` right after, which ends such threads with it. ``loop``: the loop to run it on
    (default: a new asyncio one)."""
    loop = loop or asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(main)


def exit_on_sigterm(signum: int, frame: object) -> NoReturn:
    """A SIGTERM handler that unwinds like Ctrl-C's KeyboardInterrupt does (``SystemExit``,
    exit status 128 + the signal's number): ``with`` blocks close what they started."""
    raise SystemExit(128 + signum)


def exit_now(code: int) -> NoReturn:
    """Ends the process once its work is done (the server stopped, its engine shut down),
    skipping the interpreter's teardown: with torch and vLLM loaded it took ~1.7 s here, every
    one of them between a supervisor's SIGTERM and the exit it waits for."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag`` set to ``value`` (replaced where given, else added)."""
    if flag in args:
        position = args.index(flag)
        return [*args[:position], flag, value, *args[position + 2 :]]
    prefixed = [a for a in args if a.startswith(f"{flag}=")]
    if prefixed:
        return [f"{flag}={value}" if a in prefixed else a for a in args]
    return [*args, flag, value]
