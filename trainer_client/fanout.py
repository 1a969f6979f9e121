"""Running one control call on every server at once, with results per server."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from trainer_client.exceptions import FanOutError, ServerError

T = TypeVar("T")


async def fan_out(
    operation: str,
    addresses: Sequence[str],
    call: Callable[[str], Awaitable[T]],
) -> dict[str, T]:
    """Runs ``call(address)`` for every address concurrently.

    Returns every result by address, or raises ``FanOutError`` naming the servers that failed
    and carrying the outcomes of those that succeeded.
    """
    if not addresses:
        raise ValueError(f"{operation}: the client has no server addresses to fan out to")
    outcomes = await asyncio.gather(*(call(a) for a in addresses), return_exceptions=True)
    results: dict[str, T] = {}
    failures: dict[str, ServerError] = {}
    for address, outcome in zip(addresses, outcomes, strict=True):
        if isinstance(outcome, grpc.aio.AioRpcError):
            failures[address] = ServerError.from_rpc_error(address, outcome)
        elif isinstance(outcome, ServerError):
            failures[address] = outcome
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            results[address] = outcome
    if failures:
        raise FanOutError(operation, failures, results)
    return results


async def failures_of(
    addresses: Sequence[str], call: Callable[[str], Awaitable[object]]
) -> dict[str, BaseException]:
    """Runs ``call(address)`` for every address concurrently; returns the failures by address
    (for callers that decide per server what a failure means, like a weight transaction)."""
    outcomes = await asyncio.gather(*(call(a) for a in addresses), return_exceptions=True)
    failures: dict[str, BaseException] = {}
    for address, outcome in zip(addresses, outcomes, strict=True):
        if isinstance(outcome, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
            raise outcome
        if isinstance(outcome, BaseException):
            failures[address] = outcome
    return failures
