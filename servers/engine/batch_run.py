"""One GenerateBatch call on a server: its requests admitted in order, run on the engine as one
group, their chunks handed over one engine step at a time.

The servicer checks and prepares each request (``PreparedRequest``, as for GenerateStream) and
hands the batch to ``BatchRun``: a request it refused, and one that fails later (the admission
queue full, its id in flight, an engine error), becomes that request's ``BatchError`` while the
others go on. Every request that advanced in an engine step is one chunk of the step's message
(``StreamGroup`` gathers them on the engine's loop); a reader that falls behind gets the steps
it missed merged into one message. Leaving the stream (the caller cancelled) aborts every
request still running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from skyrl_grpc.errors import SkyrlError
from skyrl_grpc.v1 import data_plane_pb2

from .adapters import LoadedAdapter
from .admission import Admission
from .convert import merge_backlog
from .engine_loop import Ended
from .vllm_engine import VllmEngine

StreamMessage = data_plane_pb2.GenerateStreamResponse
Messages = Callable[[Any], list[StreamMessage]]


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


def batch_error(index: int, error: BaseException) -> data_plane_pb2.BatchError:
    """A request's failure as its batch reports it: the status it would have failed with
    alone (INTERNAL for what is not one of the contract's errors)."""
    code = error.code if isinstance(error, SkyrlError) else SkyrlError.code
    message = str(error) or type(error).__name__
    return data_plane_pb2.BatchError(index=index, code=code.value[0], message=message)


class BatchRun:
    """The requests of one GenerateBatch call, from ``add`` / ``refuse`` to ``responses``."""

    def __init__(self, engine: VllmEngine, admission: Admission) -> None:
        self._engine = engine
        self._admission = admission
        self._group = engine.group(self._step_messages)
        self._order: list[tuple[int, PreparedRequest]] = []
        self._errors: list[data_plane_pb2.BatchError] = []
        # Set on the engine's loop as the engine's outputs arrive.
        self._transforms: dict[Hashable, Callable[[Any], Iterable[StreamMessage]]] = {}
        self._first_sent: set[Hashable] = set()
        # Requests holding admission slots (index -> slots) and those handed to the engine.
        self._held: dict[int, int] = {}
        self._submitted: set[int] = set()
        self._running: dict[int, PreparedRequest] = {}

    def refuse(self, index: int, error: SkyrlError) -> None:
        """A request that did not pass its checks: its error, the others go on."""
        self._errors.append(batch_error(index, error))

    def add(self, index: int, prepared: PreparedRequest) -> None:
        """A request to run, in this order (admission is first come, first served)."""
        self._order.append((index, prepared))
        self._running[index] = prepared

    def _step_messages(
        self, index: Hashable, output: Any
    ) -> list[data_plane_pb2.GenerateStreamResponse]:
        """One request's chunks of a step (on the engine's loop), named by its index; the
        request id goes on its first chunk only."""
        messages = list(self._transforms[index](output))
        for message in messages:
            message.batch_index = index  # type: ignore[assignment]
            if index in self._first_sent:
                message.ClearField("request_id")
            else:
                self._first_sent.add(index)
        return messages

    async def _admit(self) -> None:
        """Hands the requests to the engine in order, each once admission lets it run."""
        for index, prepared in self._order:
            try:
                self._held[index] = await self._admission.acquire(prepared.n)
                outputs, transform = self._engine.submission(
                    prepared.request_id,
                    prepared.prompt_token_ids,
                    prepared.params,
                    prepared.messages,
                    prepared.adapter,
                )
            except SkyrlError as error:
                self._group.fail(index, error)
                continue
            self._submitted.add(index)
            self._transforms[index] = transform
            self._group.add(index, outputs)
        self._group.close()

    def _end(self, index: int, error: BaseException | None) -> None:
        """A request is done: its slots, id and adapter are given back; its error reported."""
        prepared = self._running.pop(index)
        self._admission.release(self._held.pop(index, 0))
        if index in self._submitted:
            self._submitted.discard(index)
            self._engine.finished(prepared.request_id)
        self._engine.adapters.end(prepared.adapter)
        if error is not None:
            if isinstance(error, Exception):
                error = self._engine.refusal(error, started=index in self._first_sent)
            if self._engine.dead:
                # The server is lost, not this request: the call fails UNAVAILABLE, so a
                # router (or a client routing itself) moves what has not finished elsewhere.
                raise error
            self._errors.append(batch_error(index, error))

    async def responses(self) -> AsyncIterator[data_plane_pb2.GenerateBatchResponse]:
        """The call's messages: refusals first, then a message per engine step."""
        admitting = asyncio.ensure_future(self._admit())
        try:
            if self._errors:
                yield data_plane_pb2.GenerateBatchResponse(errors=self._errors)
                self._errors = []
            steps = contextlib.aclosing(self._group.steps())
            async with steps as each_step:
                async for step in each_step:
                    chunks = []
                    for item in step:
                        if isinstance(item, Ended):
                            self._end(item.key, item.error)  # type: ignore[arg-type]
                        else:
                            chunks.append(item)
                    response = data_plane_pb2.GenerateBatchResponse(
                        chunks=merge_backlog(chunks), errors=self._errors
                    )
                    self._errors = []
                    if response.chunks or response.errors:
                        yield response
            await admitting  # done by now (the group closed); raises what it raised
        finally:
            self._group.cancel()
            admitting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await admitting
            for index in list(self._running):  # cancelled: what never ended
                self._end(index, None)
