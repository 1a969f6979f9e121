"""Waiting on Ray without holding up the caller: native waits sliced so a signal handler runs
at once, the caller's SIGTERM handling kept across ``ray.init``, actors' start answers read as
one line each, and what a call to a live actor may raise."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from servers.common.process import exit_on_sigterm
from servers.fleet import FleetStartFailed

# The longest one native Ray wait may block before the caller's signal handlers get to run.
WAIT_SLICE_SECONDS = 0.5


def not_dead_yet() -> tuple[type[Exception], ...]:
    """What a call to a live actor may raise: a timeout (the actor is busy), and Ray's
    ``ActorUnavailableError`` (out of reach for now: its node is slow to answer, or Ray is busy
    with a node that left). That one is a ``RayActorError`` too, but not a death: a supervisor
    that took it for one would kill and restart a live router or server, cutting its streams.
    A dead actor raises ``ActorDiedError`` once Ray knows, and is restarted then."""
    import ray

    return (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError)


def actors_started(calls: list[Any], names: list[str], timeout: float) -> list[Any]:
    """The answers of actors' ``start`` calls, or ``FleetStartFailed`` naming the first
    actor that failed, or that was still starting when ``timeout`` seconds ran out."""
    import ray

    def all_ready(seconds: float) -> bool:
        _, waiting = ray.wait(calls, num_returns=len(calls), timeout=seconds)
        return not waiting

    sliced(all_ready, timeout)
    _, pending = ray.wait(calls, num_returns=len(calls), timeout=0)
    answers = []
    for name, call in zip(names, calls, strict=True):
        if call in pending:
            raise FleetStartFailed.still_starting(name)
        try:
            answers.append(ray.get(call))
        except ray.exceptions.RayError as error:
            # A task's error text is its remote traceback; the cause is its last line.
            lines = [line for line in str(error).splitlines() if line.strip()]
            raise FleetStartFailed(
                f"{name} did not start: {lines[-1] if lines else error!r}"
            ) from error
    return answers


def sliced(ready: Callable[[float], bool], timeout: float) -> bool:
    """``ready(seconds)`` (a native Ray wait of at most ``seconds``) again and again until it
    says yes or ``timeout`` seconds have passed: Python runs signal handlers only between
    bytecodes, so one wait of minutes would hold up a SIGTERM (and Ray's handler would print a
    native stack dump instead)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if ready(max(0.0, min(WAIT_SLICE_SECONDS, left))):
            return True
        if left <= 0:
            return False


@contextlib.contextmanager
def callers_sigterm_kept() -> Iterator[None]:
    """``ray.init`` puts Ray's SIGTERM handling in place (a native stack dump, then death,
    with nothing closed); afterwards the caller's Python handler is back, or, where the caller
    had none, one that unwinds (``SystemExit``), so ``with RayFleet(...)`` closes what it
    started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if callable(before) else exit_on_sigterm)
