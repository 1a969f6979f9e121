"""What runs on the engine's loop for each engine step of a request: its vLLM output turned into
stream messages (``RequestMessages``: converted, coalesced to the caller's interval, stamped
with the adapter version, chat-parsed), and, for a batch, each request's messages named by its
index (``BatchSteps``). The vLLM adapter calls these as plain callables beside vLLM's own
output processing, and the servicers only relay what they return."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from servers.engine.domain.chat_output import ChatOutputParsing
from servers.engine.service.chat_convert import annotate
from servers.engine.service.data_convert import ChunkCoalescer, StreamConverter
from skyrl_grpc.v1 import data_plane_pb2

StreamMessage = data_plane_pb2.GenerateStreamResponse


class RequestMessages:
    """One request's vLLM outputs as stream messages (called on the engine's loop)."""

    def __init__(
        self,
        converter: StreamConverter,
        coalescer: ChunkCoalescer,
        weight_version: Callable[[], int],
        lora_version: int,
        parsing: ChatOutputParsing | None,
    ) -> None:
        self._converter = converter
        self._coalescer = coalescer
        self._weight_version = weight_version
        self._lora_version = lora_version
        self._parsing = parsing

    def __call__(self, output: Any) -> list[StreamMessage]:
        chunks = self._converter.chunks(output, self._weight_version())
        ready = [ready for chunk in chunks for ready in self._coalescer.push(chunk)]
        for message in ready:
            self._converter.sendable(message)
            if self._lora_version:
                message.lora_version = self._lora_version
            if self._parsing is not None:
                annotate(self._parsing, message)
        return ready


class BatchSteps:
    """The requests of one batch call: each request's messages of a step, named by its index,
    its id on its first message only (called on the engine's loop)."""

    def __init__(self) -> None:
        # Set as each request is handed to the engine: its outputs' messages.
        self._transforms: dict[Hashable, Callable[[Any], Iterable[StreamMessage]]] = {}
        self._first_sent: set[Hashable] = set()

    def add(self, index: Hashable, transform: Callable[[Any], Iterable[StreamMessage]]) -> None:
        self._transforms[index] = transform

    def started(self, index: Hashable) -> bool:
        """Whether request ``index`` sent a message yet."""
        return index in self._first_sent

    def forget(self, index: Hashable) -> None:
        """Request ``index`` ended: the index may name another request later."""
        self._transforms.pop(index, None)
        self._first_sent.discard(index)

    def __call__(self, index: Hashable, output: Any) -> list[StreamMessage]:
        messages = list(self._transforms[index](output))
        for message in messages:
            message.batch_index = index  # type: ignore[assignment]
            if index in self._first_sent:
                message.ClearField("request_id")
            else:
                self._first_sent.add(index)
        return messages
