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
batches: one wake-up of that loop per batch, not one per item; the consumer takes every item
that is waiting at once (``stream_batches``), so a consumer that fell behind catches up in one
step. ``StreamGroup`` runs many iterators there for one consumer and hands over what they all
produced in one pass of the engine loop (one engine step's outputs) as one list.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Hashable,
    Iterable,
)
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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

    def __init__(
        self,
        name: str = "vllm-engine",
        new_loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
    ) -> None:
        self.loop = new_loop()
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

    def _relay(self) -> _Relay:
        """The relay to the running loop (one per consumer loop)."""
        here = asyncio.get_running_loop()
        relay = self._relays.get(here)
        if relay is None:
            relay = self._relays[here] = _Relay(here)
        return relay

    async def stream(
        self,
        iterator: Callable[[], AsyncIterator[T]],
        transform: Callable[[T], Iterable[U]],
    ) -> AsyncIterator[U]:
        """Iterates ``iterator()`` on the engine loop, turns each item into zero or more items
        with ``transform`` there, and yields those here."""
        async for items in self.stream_batches(iterator, transform):
            for item in items:
                yield item

    async def stream_batches(
        self,
        iterator: Callable[[], AsyncIterator[T]],
        transform: Callable[[T], Iterable[U]],
    ) -> AsyncIterator[list[U]]:
        """``stream``, yielding every item that has arrived since the consumer last asked as
        one list (one item when it keeps up; what piled up when it fell behind)."""
        relay = self._relay()
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
                batch = [await items.get()]
                while not items.empty():
                    batch.append(items.get_nowait())
                for position, item in enumerate(batch):
                    if item is _END or isinstance(item, BaseException):
                        if position:
                            yield batch[:position]
                        if isinstance(item, BaseException) and not isinstance(
                            item, asyncio.CancelledError
                        ):
                            raise item
                        return  # done, or cancelled over there (shutdown): it just ends
                yield batch
        finally:
            producer.cancel()  # the consumer went away: stop the work over there

    def group(self, transform: Callable[[Hashable, Any], Iterable[U]]) -> StreamGroup[U]:
        """A ``StreamGroup`` whose consumer is the running loop."""
        return StreamGroup(self.loop, self._relay(), transform)

    def close(self) -> None:
        """Stops the loop once its pending callbacks have run."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


@dataclass(frozen=True, slots=True)
class Ended:
    """A member of a ``StreamGroup`` is done: its iterator ended (``error`` None) or raised."""

    key: Hashable
    error: BaseException | None = None


class StreamGroup(Generic[U]):
    """Many async iterators run on the engine loop for one consumer on another loop.

    ``add`` starts one (from any thread); its items go through ``transform(key, item)`` on the
    engine loop into a list shared by the group, which is handed to the consumer once per pass
    of the engine loop: every member woken by one engine step contributes to one list, so the
    consumer wakes once per step, not once per member. A member's end (or error) arrives as
    ``Ended`` in the same lists; so does the end of one cancelled alone (``cancel_member``).
    ``steps`` yields the lists (all that waited, merged, when the consumer fell behind) until
    ``close`` was called and every member ended, or raises what ``fail_all`` was given;
    leaving it (or ``cancel``) cancels every member. ``fail``, ``fail_all``, ``close`` and
    ``steps`` belong to the consumer's loop.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        relay: _Relay,
        transform: Callable[[Hashable, Any], Iterable[U]],
    ) -> None:
        self._loop = loop
        self._relay = relay
        self._transform = transform
        self._queue: asyncio.Queue[list[U | Ended]] = asyncio.Queue()
        self._pending: list[U | Ended] = []
        self._flush_scheduled = False
        # On the engine loop: running members, those cancelled alone, and whether all were.
        self._members: dict[Hashable, asyncio.Task[None]] = {}
        self._dropped: set[Hashable] = set()
        self._cancelled = False
        self._closed = False
        self._failure: BaseException | None = None
        self.started = 0
        self.ended = 0

    def add(self, key: Hashable, iterator: Callable[[], AsyncIterator[Any]]) -> None:
        """Starts iterating ``iterator()`` on the engine loop (from any thread)."""
        self.started += 1
        self._loop.call_soon_threadsafe(self._start, key, iterator)

    def fail(self, key: Hashable, error: BaseException) -> None:
        """A member that failed before it could start: its ``Ended`` comes out of ``steps``
        as a started member's would."""
        self.started += 1
        self._queue.put_nowait([Ended(key, error)])

    def fail_all(self, error: BaseException) -> None:
        """Ends the whole group: ``steps`` raises ``error`` (and cancels every member)."""
        self._failure = error
        self._queue.put_nowait([])  # wakes ``steps`` to look

    def close(self) -> None:
        """No member will be added any more: ``steps`` ends once those added have ended."""
        self._closed = True
        self._queue.put_nowait([])  # wakes ``steps`` to look

    def _start(self, key: Hashable, iterator: Callable[[], AsyncIterator[Any]]) -> None:
        if self._cancelled:
            return
        task = self._loop.create_task(self._produce(key, iterator))
        self._members[key] = task
        task.add_done_callback(lambda _: self._members.pop(key, None))

    async def _produce(self, key: Hashable, iterator: Callable[[], AsyncIterator[Any]]) -> None:
        try:
            async for raw in iterator():
                items = self._transform(key, raw)
                if items:
                    self._pending.extend(items)
                    self._schedule_flush()
        except asyncio.CancelledError:
            if key not in self._dropped:
                raise  # the whole group: nobody waits for its ends any more
            self._dropped.discard(key)
            self._pending.append(Ended(key))
        except BaseException as error:
            self._pending.append(Ended(key, error))
        else:
            self._pending.append(Ended(key))
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        # Members woken by one engine step all run before a callback scheduled by the first.
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        if pending:
            self._relay.post(self._queue, pending)

    async def steps(self) -> AsyncGenerator[list[U | Ended], None]:
        """What the members produced, a list per engine step (empty lists skipped), until the
        group is closed and every member has ended."""
        try:
            while not (self._closed and self.ended >= self.started):
                step = await self._queue.get()
                while not self._queue.empty():
                    step.extend(self._queue.get_nowait())
                if self._failure is not None:
                    raise self._failure
                if step:
                    self.ended += sum(isinstance(item, Ended) for item in step)
                    yield step
        finally:
            self.cancel()

    def cancel_member(self, key: Hashable) -> None:
        """Cancels one member (from any thread): its ``Ended`` follows, with no error."""
        self._loop.call_soon_threadsafe(self._cancel_one, key)

    def _cancel_one(self, key: Hashable) -> None:
        # Callbacks run in the order they were scheduled: a member added before this was
        # asked for has started, so one not running any more has ended already.
        task = self._members.get(key)
        if task is not None:
            self._dropped.add(key)
            task.cancel()

    def cancel(self) -> None:
        """Cancels every member still running (from any thread)."""
        self._loop.call_soon_threadsafe(self._cancel_all)

    def _cancel_all(self) -> None:
        self._cancelled = True
        for task in list(self._members.values()):
            task.cancel()
