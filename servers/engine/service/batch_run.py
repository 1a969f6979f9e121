"""Many generation requests of one call on a server (GenerateBatch, GenerateMultiplex): admitted
in order, run on the engine as one group, their chunks handed over one engine step at a time.

The servicer checks and prepares each request (``PreparedRequest``, as for GenerateStream) and
adds it to a ``BatchRun``: a request it refused, and one that fails later (the admission queue
full, its id in flight, an engine error), becomes that request's ``BatchError`` while the others
go on. Every request that advanced in an engine step is one chunk of the step's message
(``StreamGroup`` gathers them on the engine's loop); a reader that falls behind gets the steps
it missed merged into one message. Requests may join until ``close`` (GenerateBatch adds them
all at once; GenerateMultiplex as its caller sends them) and be cancelled one by one. Leaving
the stream (the caller cancelled) aborts every request still running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from servers.engine.domain.admission import Admission
from servers.engine.domain.lora_adapters import AdapterManager, LoadedAdapter
from servers.engine.domain.weights.serving import ServingWeights
from servers.engine.service.stream_steps import BatchSteps
from servers.engine.vllm_adapter.engine_loop import Ended
from servers.engine.vllm_adapter.vllm_engine import VllmEngine
from skyrl_grpc.batch_shape import check_unused
from skyrl_grpc.errors import SkyrlError
from skyrl_grpc.stream_chunks import merge_backlog
from skyrl_grpc.v1 import data_plane_pb2

StreamMessage = data_plane_pb2.GenerateStreamResponse
Messages = Callable[[Any], list[StreamMessage]]
Response = data_plane_pb2.GenerateBatchResponse | data_plane_pb2.GenerateMultiplexResponse
_CLOSED = object()


@dataclass
class PreparedRequest:
    """A generation request that passed its checks: what the engine runs, and how its outputs
    become stream messages (run on the engine's loop)."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any  # vLLM's SamplingParams
    n: int
    messages: Messages
    adapter: LoadedAdapter | None
    # The W3C trace context of the call (or multiplexed request) it came in (tracing on).
    trace_headers: dict[str, str] = field(default_factory=dict)


def batch_error(index: int, error: BaseException) -> data_plane_pb2.BatchError:
    """A request's failure as its batch reports it: the status it would have failed with
    alone (INTERNAL for what is not one of the contract's errors)."""
    code = error.code if isinstance(error, SkyrlError) else SkyrlError.code
    message = str(error) or type(error).__name__
    return data_plane_pb2.BatchError(index=index, code=code.value[0], message=message)


class BatchRun:
    """The requests of one call, from ``add`` / ``refuse`` / ``cancel`` to ``responses``
    (whose messages are ``response``: GenerateBatchResponse or GenerateMultiplexResponse)."""

    def __init__(
        self,
        engine: VllmEngine,
        weights: ServingWeights,
        adapters: AdapterManager,
        admission: Admission,
        response: type[Response] = data_plane_pb2.GenerateBatchResponse,
    ) -> None:
        self._engine = engine
        self._weights = weights
        self._adapters = adapters
        self._admission = admission
        self._response = response
        self._steps = BatchSteps()  # runs on the engine's loop
        self._group = engine.group(self._steps)
        # Requests waiting for admission, in order (``_CLOSED`` once no more will come).
        self._waiting: asyncio.Queue[Any] = asyncio.Queue()
        # Requests added and not ended (index -> request); those cancelled while waiting;
        # admission slots held (index -> slots); those handed to the engine.
        self._running: dict[int, PreparedRequest] = {}
        self._cancelled: set[int] = set()
        self._held: dict[int, int] = {}
        self._submitted: set[int] = set()

    def refuse(self, index: int, error: SkyrlError) -> None:
        """A request that did not pass its checks: its error, the others go on."""
        self._group.fail(index, error)

    def check_unused(self, indices: Iterable[int]) -> None:
        """INVALID_ARGUMENT when one of ``indices`` names a request still running
        (``batch_shape.check_unused``)."""
        check_unused(indices, self._running)

    def add(self, index: int, prepared: PreparedRequest) -> None:
        """A request to run after those added before it (admission is first come, first
        served); its index is not one in use (``check_unused``)."""
        self._running[index] = prepared
        self._waiting.put_nowait((index, prepared))

    def cancel(self, index: int) -> None:
        """The caller gave up on a request: aborted if it runs, dropped if it waits; it sends
        nothing more."""
        if index not in self._running or index in self._cancelled:
            return
        self._cancelled.add(index)
        if index in self._submitted:
            self._group.cancel_member(index)

    def close(self) -> None:
        """No request will be added any more: the responses end once those added have."""
        self._waiting.put_nowait(_CLOSED)

    def fail(self, error: BaseException) -> None:
        """Ends the whole call with ``error`` (e.g. a malformed message of the caller's)."""
        self._group.fail_all(error)

    async def _admit(self) -> None:
        """Hands the requests to the engine in order, each once admission lets it run."""
        while (item := await self._waiting.get()) is not _CLOSED:
            index, prepared = item
            if index in self._cancelled:
                self._group.fail(index, asyncio.CancelledError())
                continue
            try:
                self._held[index] = await self._admission.acquire(prepared.n)
                self._weights.generation_starts()
                outputs, transform = self._engine.submission(
                    prepared.request_id,
                    prepared.prompt_token_ids,
                    prepared.params,
                    prepared.messages,
                    prepared.adapter,
                    self._weights.cache_salt,
                    prepared.trace_headers,
                )
            except SkyrlError as error:
                self._group.fail(index, error)
                continue
            if index in self._cancelled:  # given up on while it waited for its turn
                self._engine.finished(prepared.request_id)
                self._group.fail(index, asyncio.CancelledError())
                continue
            self._submitted.add(index)
            self._steps.add(index, transform)
            self._group.add(index, outputs)
        self._group.close()

    def _end(self, index: int, error: BaseException | None) -> data_plane_pb2.BatchError | None:
        """A request is done: its slots, id and adapter are given back; its error, if the
        caller is to hear of it."""
        prepared = self._running.pop(index, None)
        self._admission.release(self._held.pop(index, 0))
        if prepared is not None:
            if index in self._submitted:
                self._engine.finished(prepared.request_id)
            self._adapters.end(prepared.adapter)
        started = self._steps.started(index)
        self._submitted.discard(index)
        self._steps.forget(index)
        if index in self._cancelled:
            self._cancelled.discard(index)
            return None  # the caller gave up on it: nothing more is sent
        if error is None:
            return None
        if isinstance(error, Exception):
            error = self._engine.refusal(error, started=started)
        if self._engine.dead:
            # The server is lost, not this request: the call fails UNAVAILABLE, so a router
            # (or a client routing itself) moves what has not finished elsewhere.
            raise error
        return batch_error(index, error)

    async def responses(self) -> AsyncIterator[Response]:
        """The call's messages, one per engine step (refusals as they happen)."""
        admitting = asyncio.ensure_future(self._admit())
        try:
            async with contextlib.aclosing(self._group.steps()) as steps:
                async for step in steps:
                    chunks, errors = [], []
                    for item in step:
                        if not isinstance(item, Ended):
                            if item.batch_index not in self._cancelled:
                                chunks.append(item)
                        elif (error := self._end(item.key, item.error)) is not None:  # type: ignore[arg-type]
                            errors.append(error)
                    if chunks or errors:
                        yield self._response(chunks=merge_backlog(chunks), errors=errors)
            await admitting  # done by now (the group closed); raises what it raised
        finally:
            self._group.cancel()
            admitting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await admitting
            for index in list(self._running):  # cancelled: what never ended
                self._end(index, None)
