"""vLLM's engine client on an event loop and thread of its own, away from the gRPC loop.

vLLM's ``AsyncLLM`` does its output processing in the event loop that runs it: decoding the
engine process's messages, building logprobs, updating stats, waking every request. Under a
saturated engine that took 60-85% of the server's one event loop (profiled with py-spy), and
every control call (GetLoad, Pause, Resume) queued behind it: GetLoad's p99 was 4.7 s with 64
streams asking for logprobs. On its own loop, that work no longer sits in the gRPC loop's queue:
the gRPC loop only waits for the GIL, which Python hands over every few milliseconds.

``EngineLoop`` runs coroutines there (``call``) and relays async iterators from there
(``stream``), transformed there first (the data plane's conversion to protobuf runs on the
engine's side too, keeping the gRPC loop light); cancelling the consumer cancels the producer
(vLLM then aborts the request). Items crossing to the consumer's loop are handed over in
batches: one wake-up of that loop per batch, not one per item.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
U = TypeVar("U")
_END = object()


class _Relay:
    """Hands items from the engine thread to queues on one other loop, in batches."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[Any], object]] = []

    def post(self, queue: asyncio.Queue[Any], item: object) -> None:
        with self._lock:
            self._pending.append((queue, item))
            first = len(self._pending) == 1
        if first:  # the loop's next flush takes this item and any posted before it runs
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, item in pending:
            queue.put_nowait(item)


class EngineLoop:
    """A private event loop running in a daemon thread until ``close()``."""

    def __init__(self, name: str = "vllm-engine") -> None:
        self.loop = asyncio.new_event_loop()
        self._relays: dict[asyncio.AbstractEventLoop, _Relay] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs ``coroutine`` on the engine loop; awaiting it from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    async def run(self, function: Callable[[], T]) -> T:
        """Runs a blocking ``function`` in the engine loop's thread (e.g. building the engine,
        whose tasks must belong to that loop)."""

        async def invoke() -> T:
            return function()

        return await self.call(invoke())

    async def stream(
        self,
        iterator: Callable[[], AsyncIterator[T]],
        transform: Callable[[T], Iterable[U]],
    ) -> AsyncIterator[U]:
        """Iterates ``iterator()`` on the engine loop, turns each item into zero or more items
        with ``transform`` there, and yields those here."""
        here = asyncio.get_running_loop()
        relay = self._relays.get(here)
        if relay is None:
            relay = self._relays[here] = _Relay(here)
        items: asyncio.Queue[Any] = asyncio.Queue()

        def post(item: object) -> None:
            relay.post(items, item)

        async def produce() -> None:
            try:
                async for raw in iterator():
                    for item in transform(raw):
                        post(item)
            except BaseException as error:  # relayed to the consumer, raised there
                post(error)
                if isinstance(error, asyncio.CancelledError):
                    raise
            else:
                post(_END)

        producer = asyncio.run_coroutine_threadsafe(produce(), self.loop)
        try:
            while True:
                item = await items.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        return  # cancelled over there (shutdown): the stream just ends
                    raise item
                yield item
        finally:
            producer.cancel()  # the consumer went away: stop the work over there

    def close(self) -> None:
        """Stops the loop once its pending callbacks have run."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
