"""DataPlane servicer: validate, call the engine, convert. The request rules live in
``validate`` (the tool-choice rules, which need the model's parsers, in ``chat_parsing``), the
conversions in ``convert``, the engine calls in ``vllm_engine``; batches run in ``batch_run``."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from skyrl_grpc.errors import SkyrlError
from skyrl_grpc.metadata import session_of
from skyrl_grpc.sample_assembly import ResponseAssembler
from skyrl_grpc.stream_chunks import merge_backlog
from skyrl_grpc.v1 import chat_tools_pb2, data_plane_pb2, data_plane_pb2_grpc, generation_pb2

from ..common.grpc_types import Context
from . import convert, validate
from .admission import Admission
from .batch_run import BatchRun, PreparedRequest
from .chat_parsing import message_dicts, tool_dicts
from .convert import ChunkCoalescer, StreamConverter, build_sampling_params
from .engine_parts import EngineParts
from .serving_state import ServingState

GenerateLike = data_plane_pb2.GenerateRequest | data_plane_pb2.GenerateStreamRequest


class DataPlaneServicer(data_plane_pb2_grpc.DataPlaneServicer):
    """Serves generation and tokenizer calls from one vLLM engine."""

    def __init__(self, state: ServingState[EngineParts], admission: Admission) -> None:
        self._state = state
        self._admission = admission

    def _engine_for(self, request_id: str, n: int, context: Context) -> tuple[EngineParts, int]:
        """The engine, once the request's cheapest checks pass (before any prompt work); the
        request's session, if it names one, is live here from now."""
        parts = self._state.parts()
        validate.request_id(request_id, parts.limits)
        resolved = validate.sample_count(n, parts.limits)
        self._touch_session(parts, session_of(context.invocation_metadata()))
        return parts, resolved

    @staticmethod
    def _touch_session(parts: EngineParts, session: str | None) -> None:
        """A request names its session: it is live here from now."""
        if session and parts.sessions.touch(session):
            parts.status_changed()  # placers learn where the new session lives

    def _prepare(
        self,
        parts: EngineParts,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: generation_pb2.SamplingParams,
        n: int,
        include_text: bool,
        stream_interval: int = 0,
        lora: str = "",
        chat: chat_tools_pb2.ChatOutput | None = None,
    ) -> PreparedRequest:
        """A checked request, ready to start: vLLM's sampling parameters, the conversion of
        its outputs into stream messages, the adapter it runs on (held until it ends)."""
        request_id = request_id or uuid.uuid4().hex
        parsing = None
        if chat is not None:
            # vLLM's server's rules for the tools: the choice checked, a required or named
            # choice turned into a constraint, the samples parsed as they come.
            sampling, parsing = parts.chat_parsers.prepare(chat, sampling, prompt_token_ids, n)
            skip = (
                sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True
            )
            parsing.resume(lambda ids: parts.tokenizer.decode(ids, skip))
            include_text = True
        max_tokens = validate.sampling(
            sampling, prompt_len=len(prompt_token_ids), limits=parts.limits
        )
        params = build_sampling_params(
            sampling, n=n, max_tokens=max_tokens, detokenize=include_text
        )
        converter = StreamConverter(request_id, prompt_token_ids, params, include_text)
        coalescer = ChunkCoalescer(stream_interval)
        adapter = parts.adapters.begin(lora)
        weights = parts.weights
        lora_version = adapter.version if adapter is not None else 0

        def messages(output: Any) -> list[data_plane_pb2.GenerateStreamResponse]:
            # Runs on the engine's loop (see vllm_engine.generate): this loop only relays.
            chunks = converter.chunks(output, weights.version)
            ready = [ready for chunk in chunks for ready in coalescer.push(chunk)]
            for message in ready:
                if lora_version:
                    message.lora_version = lora_version
                if parsing is not None:
                    parsing.annotate(message)
            return ready

        return PreparedRequest(request_id, prompt_token_ids, params, n, messages, adapter)

    async def _stream(
        self, parts: EngineParts, prepared: PreparedRequest
    ) -> AsyncIterator[data_plane_pb2.GenerateStreamResponse]:
        try:
            async with self._admission.admit(prepared.n):
                outputs = parts.engine.generate(
                    prepared.request_id,
                    prepared.prompt_token_ids,
                    prepared.params,
                    prepared.messages,
                    prepared.adapter,
                    parts.weights.cache_salt,
                )
                async for messages in outputs:
                    # More than one when this reader fell behind: it gets them merged.
                    for message in merge_backlog(messages):
                        yield message
        finally:
            parts.adapters.end(prepared.adapter)

    def _prepare_generation(
        self, parts: EngineParts, request: GenerateLike, n: int, stream_interval: int = 0
    ) -> PreparedRequest:
        """A Generate / GenerateStream request of ``n`` (checked) samples, checked and
        prepared."""
        prompt = validate.prompt(request.prompt_token_ids, parts.limits, "prompt_token_ids")
        return self._prepare(
            parts,
            request.request_id,
            prompt,
            request.sampling_params,
            n,
            request.include_text,
            stream_interval,
            request.lora,
            request.chat_output
            if isinstance(request, data_plane_pb2.GenerateStreamRequest)
            and request.HasField("chat_output")
            else None,
        )

    def _token_stream(
        self, request: GenerateLike, context: Context, stream_interval: int = 0
    ) -> AsyncIterator[data_plane_pb2.GenerateStreamResponse]:
        parts, n = self._engine_for(request.request_id, request.n, context)
        return self._stream(parts, self._prepare_generation(parts, request, n, stream_interval))

    async def _collect(
        self, stream: AsyncIterator[data_plane_pb2.GenerateStreamResponse]
    ) -> ResponseAssembler:
        assembler = ResponseAssembler()
        async for chunk in stream:
            assembler.add(chunk)
        return assembler

    async def GenerateStream(
        self, request: data_plane_pb2.GenerateStreamRequest, context: Context
    ) -> AsyncIterator[data_plane_pb2.GenerateStreamResponse]:
        async for chunk in self._token_stream(request, context, request.stream_interval):
            yield chunk

    async def GenerateBatch(
        self, request: data_plane_pb2.GenerateBatchRequest, context: Context
    ) -> AsyncIterator[data_plane_pb2.GenerateBatchResponse]:
        parts = self._state.parts()
        batch = BatchRun(parts, self._admission)
        self._add_batch(parts, batch, request)
        batch.close()
        async for response in batch.responses():
            yield response  # type: ignore[misc]

    async def GenerateMultiplex(
        self,
        request_iterator: AsyncIterator[data_plane_pb2.GenerateMultiplexRequest],
        context: Context,
    ) -> AsyncIterator[data_plane_pb2.GenerateMultiplexResponse]:
        parts = self._state.parts()
        batch = BatchRun(parts, self._admission, data_plane_pb2.GenerateMultiplexResponse)

        async def read() -> None:
            try:
                async for message in request_iterator:
                    if message.HasField("add"):
                        self._add_batch(parts, batch, message.add)
                    for index in message.cancel:
                        batch.cancel(index)
            except Exception as error:  # a malformed message: the call ends with its status
                batch.fail(error)
            finally:
                batch.close()

        reading = asyncio.ensure_future(read())
        try:
            async for response in batch.responses():
                yield response  # type: ignore[misc]
        finally:
            reading.cancel()

    def _add_batch(
        self, parts: EngineParts, batch: BatchRun, request: data_plane_pb2.GenerateBatchRequest
    ) -> None:
        """Each request of ``request`` checked, prepared and added to ``batch``, or refused
        there; a malformed batch (its shape) is refused whole."""
        indices, sessions = validate.batch(request, self._admission.capacity)
        batch.check_unused(indices)
        for index, item, session in zip(indices, request.requests, sessions, strict=True):
            try:
                validate.request_id(item.request_id, parts.limits)
                n = validate.sample_count(item.n, parts.limits)
                self._touch_session(parts, session)
                prepared = self._prepare_generation(parts, item, n, item.stream_interval)
            except SkyrlError as error:
                batch.refuse(index, error)
                continue
            batch.add(index, prepared)

    async def Generate(
        self, request: data_plane_pb2.GenerateRequest, context: Context
    ) -> data_plane_pb2.GenerateResponse:
        result = await self._collect(self._token_stream(request, context))
        response = data_plane_pb2.GenerateResponse(
            request_id=result.request_id, samples=result.samples(), usage=result.usage
        )
        if result.prompt_logprobs is not None:
            response.prompt_logprobs.CopyFrom(result.prompt_logprobs)
        return response

    async def _text_result(
        self,
        parts: EngineParts,
        request: data_plane_pb2.ChatRequest | data_plane_pb2.CompleteRequest,
        prompt: list[int],
        n: int,
        chat: chat_tools_pb2.ChatOutput | None = None,
    ) -> ResponseAssembler:
        """A chat or completion request's whole result, with text."""
        prepared = self._prepare(
            parts,
            request.request_id,
            prompt,
            request.sampling_params,
            n,
            True,
            lora=request.lora,
            chat=chat,
        )
        return await self._collect(self._stream(parts, prepared))

    async def Chat(
        self, request: data_plane_pb2.ChatRequest, context: Context
    ) -> data_plane_pb2.ChatResponse:
        parts, n = self._engine_for(request.request_id, request.n, context)
        prompt = self._render_chat(parts, request.messages, request, request.tool_use.tools)
        chat = chat_tools_pb2.ChatOutput(tool_use=request.tool_use, whole_messages=True)
        result = await self._text_result(parts, request, prompt, n, chat)
        samples = result.samples()
        messages = [
            result.chat_messages.get(i) or chat_tools_pb2.ChatMessageOut(content=sample.text)
            for i, sample in enumerate(samples)
        ]
        return data_plane_pb2.ChatResponse(
            request_id=result.request_id,
            prompt_token_ids=prompt,
            samples=samples,
            usage=result.usage,
            messages=messages,
        )

    async def Complete(
        self, request: data_plane_pb2.CompleteRequest, context: Context
    ) -> data_plane_pb2.CompleteResponse:
        parts, n = self._engine_for(request.request_id, request.n, context)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        validate.text_length(
            request.prompt, parts.limits, parts.tokenizer.longest_token_bytes, "prompt"
        )
        prompt = validate.prompt(
            parts.tokenizer.encode(request.prompt, add_special),
            parts.limits,
            "the tokenized prompt",
        )
        result = await self._text_result(parts, request, prompt, n)
        return data_plane_pb2.CompleteResponse(
            request_id=result.request_id,
            prompt_token_ids=prompt,
            samples=result.samples(),
            usage=result.usage,
        )

    async def Tokenize(
        self, request: data_plane_pb2.TokenizeRequest, context: Context
    ) -> data_plane_pb2.TokenizeResponse:
        parts = self._state.parts()
        if request.HasField("conversation"):
            conversation = request.conversation
            ids = self._render_chat(parts, conversation.messages, conversation, conversation.tools)
        else:
            add_special = (
                request.add_special_tokens if request.HasField("add_special_tokens") else True
            )
            validate.text_length(
                request.text, parts.limits, parts.tokenizer.longest_token_bytes, "text"
            )
            ids = parts.tokenizer.encode(request.text, add_special)
        return data_plane_pb2.TokenizeResponse(token_ids=ids)

    def _render_chat(
        self,
        parts: EngineParts,
        messages: Sequence[data_plane_pb2.ChatMessage],
        options: data_plane_pb2.ChatRequest | data_plane_pb2.ChatConversation,
        tools: Sequence[chat_tools_pb2.Tool] = (),
    ) -> list[int]:
        """The messages through the chat template, as a checked prompt."""
        validate.chat_messages(messages)
        validate.text_length(
            "".join(m.content for m in messages),
            parts.limits,
            parts.tokenizer.longest_token_bytes,
            "the messages' content",
        )
        add_generation_prompt = (
            options.add_generation_prompt if options.HasField("add_generation_prompt") else True
        )
        rendered = parts.tokenizer.apply_chat_template(
            message_dicts(messages), add_generation_prompt, tool_dicts(tools) if tools else None
        )
        return validate.prompt(rendered, parts.limits, "the rendered chat prompt")

    async def Detokenize(
        self, request: data_plane_pb2.DetokenizeRequest, context: Context
    ) -> data_plane_pb2.DetokenizeResponse:
        parts = self._state.parts()
        validate.token_ids(request.token_ids, parts.limits, "token_ids")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return data_plane_pb2.DetokenizeResponse(
            text=parts.tokenizer.decode(request.token_ids, skip)
        )

    async def GetModelInfo(
        self, request: data_plane_pb2.GetModelInfoRequest, context: Context
    ) -> data_plane_pb2.GetModelInfoResponse:
        return convert.model_info_to_proto(self._state.parts().describe_model())

    async def Abort(
        self, request: data_plane_pb2.AbortRequest, context: Context
    ) -> data_plane_pb2.AbortResponse:
        aborted = await self._state.parts().engine.abort(list(request.request_ids))
        return data_plane_pb2.AbortResponse(aborted_request_ids=aborted)

    async def FinishSession(
        self, request: data_plane_pb2.FinishSessionRequest, context: Context
    ) -> data_plane_pb2.FinishSessionResponse:
        validate.session_id(request.session_id)
        parts = self._state.parts()
        found = parts.sessions.finish(request.session_id)
        if found:
            parts.status_changed()
        return data_plane_pb2.FinishSessionResponse(found=found)
