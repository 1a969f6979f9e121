"""A streamed answer's server-sent events: each step message from the engine to the bytes the
caller reads, by one method per kind of answer (``step``), pure (no network, no awaits).

The edge gets each step's ``GenerateStreamResponse`` parsed from the router's multiplexed
call (``Proxy.generation``) and writes what ``step`` returns as it is. A step that only
carries text or token ids (every step of a stream but its first and last, unless logprobs
were asked for) is written from bytes made once per answer (the event's head: id, object,
created, model) around the step's own fields: that is every token of a long answer, and it
costs one ``orjson.dumps`` of the text instead of building and encoding two dicts. Any other
step (a choice's opening, its finish, logprobs, a chat answer's first delta) is built from
``render``'s dicts, the same keys vLLM's server writes; ``tests/edge/test_edge_render.py``
holds the two to the same JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from servers.router.http_edge import render, token_generate, tool_calls
from servers.router.http_edge.parse import GenerationCall
from skyrl_grpc.v1 import data_plane_pb2
from skyrl_grpc.v1 import generation_pb2 as gen

DONE = b"data: [DONE]\n\n"
_END = b"]}\n\n"


class Answer(Protocol):
    """A streamed answer of some kind: what each step writes, and what ends it."""

    call: GenerationCall
    # Whether its steps need their token texts (a logprobs answer that names tokens by text).
    wants_texts: bool

    def sent(self, index: int) -> Sequence[int]: ...

    def step(
        self,
        message: data_plane_pb2.GenerateStreamResponse,
        offset: int,
        prompt: Sequence[int],
        texts: render.PositionTexts = (),
    ) -> bytes: ...

    def end(self) -> bytes: ...


def event(body: Any) -> bytes:
    """One server-sent event of a JSON body."""
    return b"data: " + orjson.dumps(body) + b"\n\n"


class StreamedAnswer:
    """One streamed completion or chat answer (one or more prompts, ``n`` samples each): the
    events of each step (``step``) and of the end (``end``)."""

    # Its logprobs name tokens by their texts (``token_texts``).
    wants_texts = True

    def __init__(self, call: GenerationCall) -> None:
        self.call = call
        # The event's head up to its choices: `data: {"id":...,"choices":[`.
        self._head = b"data: " + orjson.dumps(render.chunk(call, []))[:-2]
        # Per prompt (its first choice's index): its last message, whose usage ends the stream
        # (read then, not per step).
        self._lasts: dict[int, data_plane_pb2.GenerateStreamResponse] = {}
        self._started: set[int] = set()
        self._tools_streamed: set[int] = set()
        self._text_sent: dict[int, int] = {}  # characters of each choice's text sent so far
        # Each choice's tokens sent so far, kept when the call asks for logprobs (their token
        # texts read in context).
        self._ids_sent: dict[int, list[int]] = {}
        self._keeps_ids = call.sampling.HasField("logprobs")
        # Every step through ``render``'s dicts (the tests' reference for the fast path).
        self.always_dicts = False

    def sent(self, index: int) -> Sequence[int]:
        """The tokens of choice ``index`` sent so far (a logprobs answer's context)."""
        return self._ids_sent.get(index, ())

    def step(
        self,
        message: data_plane_pb2.GenerateStreamResponse,
        offset: int,
        prompt: Sequence[int],
        texts: render.PositionTexts = (),
    ) -> bytes:
        """The events of one step of the prompt whose first choice is ``offset`` (b"" when
        the chat parser holds the step's tokens back); ``texts``: the step's token texts when
        it carries logprobs (``token_texts``)."""
        call = self.call
        index = offset + message.sample_index
        text, finish, stop_reason = message.text, None, None
        if message.finish_reason:
            finish, stop_reason, text = render.finish_of(
                message.finish_reason, message.stop, text, call
            )
        logprobs = message.logprobs if message.HasField("logprobs") else None
        if self._keeps_ids:
            self._ids_sent.setdefault(index, []).extend(message.token_ids)
        first = index not in self._started
        self._started.add(index)
        self._lasts[offset] = message
        opening = b""
        delta = None
        if call.chat:
            if first:  # each choice opens with its role, as vLLM's server sends it
                opening = event(render.role_chunk(call, index, prompt))
                first = False
            if message.HasField("chat_delta"):
                delta = tool_calls.delta_fields(message.chat_delta)
                if message.chat_delta.tool_calls:
                    self._tools_streamed.add(index)
            elif finish is None and logprobs is None and not call.return_token_ids:
                return opening  # the parser holds these tokens back (e.g. a call's markup)
            else:
                delta = {}
            finish = tool_calls.streamed_finish_reason(
                call.tool_use, index in self._tools_streamed, finish
            )
        text_offset = self._text_sent.get(index, 0)
        self._text_sent[index] = text_offset + len(text)
        if (
            finish is None
            and logprobs is None
            and not (first and call.return_token_ids)
            and not self.always_dicts
        ):
            ids = orjson.dumps(list(message.token_ids)) if call.return_token_ids else b"null"
            if call.chat:
                body = b'{"index":%d,"delta":%b,"logprobs":null,"finish_reason":null,' % (
                    index,
                    orjson.dumps(delta),
                )
                body += b'"token_ids":%b}' % ids
            else:
                body = b'{"index":%d,"text":%b,"logprobs":null,"finish_reason":null,' % (
                    index,
                    orjson.dumps(text),
                )
                body += b'"stop_reason":null,"prompt_token_ids":null,"token_ids":%b}' % ids
            return opening + self._head + body + _END
        choice = render.chunk_choice(
            call, index, text, message.token_ids, finish, stop_reason, logprobs, texts,
            first=first, prompt=prompt, delta=delta, text_offset=text_offset,
        )  # fmt: skip
        return opening + event(render.chunk(call, [choice]))

    def end(self) -> bytes:
        """What ends the stream: the usage event (when asked for), then [DONE]."""
        if not self.call.include_usage:
            return DONE
        usage = render.usage_of(m.usage for m in self._lasts.values())
        return event(render.chunk(self.call, [], usage)) + DONE


class TokenStream:
    """One streamed answer of vLLM's token-in / token-out endpoint (``token_generate``)."""

    wants_texts = False  # its logprobs name tokens by id

    def __init__(self, call: GenerationCall) -> None:
        self.call = call
        self._usage: gen.Usage | None = None

    def sent(self, index: int) -> Sequence[int]:
        return ()

    def step(
        self,
        message: data_plane_pb2.GenerateStreamResponse,
        offset: int,
        prompt: Sequence[int],
        texts: render.PositionTexts = (),
    ) -> bytes:
        self._usage = message.usage
        finish, stop_reason = None, None
        if message.finish_reason:
            finish, stop_reason, _ = render.finish_of(
                message.finish_reason, message.stop, "", self.call
            )
        sample = gen.Sample(token_ids=message.token_ids)
        if message.HasField("logprobs"):
            sample.logprobs.CopyFrom(message.logprobs)
        piece = token_generate.choice(sample, finish, stop_reason, message.sample_index)
        del piece["weight_versions"]
        return event(token_generate.stream_chunk(self.call, [piece]))

    def end(self) -> bytes:
        if self._usage is None:
            return DONE
        usage = render.usage_of([self._usage])
        return event(token_generate.stream_chunk(self.call, [], usage)) + DONE
