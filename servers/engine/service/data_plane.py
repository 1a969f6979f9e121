"""DataPlane servicer: validate, call the engine, convert. The request rules live in
``validate`` (the tool-choice rules, which need the model's parsers, in the domain's
``chat_parsing``), the conversions in ``data_convert`` and ``chat_convert``, what runs on the
engine's loop per step in ``stream_steps``, the engine calls in the vLLM adapter; batches run
in ``batch_run``. Built with exactly the parts it uses (``DataPlaneParts``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from servers.common.grpc_types import Context
from servers.engine.domain.admission import Admission
from servers.engine.domain.chat_parsing import ChatParsers
from servers.engine.domain.descriptions import ModelDescription
from servers.engine.domain.live_sessions import LiveSessions
from servers.engine.domain.lora_adapters import AdapterManager
from servers.engine.domain.weights.serving import ServingWeights
from servers.engine.service import chat_convert, validate
from servers.engine.service import data_convert as convert
from servers.engine.service.batch_run import BatchRun, PreparedRequest
from servers.engine.service.data_convert import (
    ChunkCoalescer,
    StreamConverter,
    build_sampling_params,
)
from servers.engine.service.stream_steps import RequestMessages
from servers.engine.service.validate import ModelLimits
from servers.engine.vllm_adapter.tokenizer_calls import TokenizerCalls
from servers.engine.vllm_adapter.vllm_engine import VllmEngine
from skyrl_grpc import tracing
from skyrl_grpc.errors import SkyrlError
from skyrl_grpc.metadata import session_of
from skyrl_grpc.names import GENERATE_STREAM
from skyrl_grpc.sample_assembly import ResponseAssembler
from skyrl_grpc.stream_chunks import merge_backlog
from skyrl_grpc.v1 import chat_tools_pb2, data_plane_pb2, data_plane_pb2_grpc, generation_pb2

GenerateLike = data_plane_pb2.GenerateRequest | data_plane_pb2.GenerateStreamRequest


@dataclass(frozen=True)
class DataPlaneParts:
    """What the data plane serves with (built by ``process.engine_parts``)."""

    engine: VllmEngine  # generations, aborts
    tokenizer: TokenizerCalls
    limits: ModelLimits
    sessions: LiveSessions  # announces the sessions it gains and loses itself
    chat_parsers: ChatParsers
    adapters: AdapterManager  # the LoRA adapter a request runs on, held while it runs
    weights: ServingWeights  # the version stamped on tokens, the prefix-cache namespace
    describe_model: Callable[[], ModelDescription]


class DataPlaneServicer(data_plane_pb2_grpc.DataPlaneServicer):
    """Serves generation and tokenizer calls from one vLLM engine. ``parts`` gives the parts
    once the engine serves (UNAVAILABLE before)."""

    def __init__(self, parts: Callable[[], DataPlaneParts], admission: Admission) -> None:
        self._parts = parts
        self._admission = admission
        # The GenerateMultiplex calls running (``end_multiplexed_calls``).
        self._multiplexed: set[BatchRun] = set()

    def end_multiplexed_calls(self) -> None:
        """The server drains: each GenerateMultiplex call takes no more requests (those added
        now are refused UNAVAILABLE, for the caller to send elsewhere) and ends once its
        running ones have, so a caller's long-lived call does not hold the drain for its
        grace."""
        for batch in self._multiplexed:
            batch.close()

    def _engine_for(self, request_id: str, n: int, context: Context) -> tuple[DataPlaneParts, int]:
        """The engine, once the request's cheapest checks pass (before any prompt work); the
        request's session, if it names one, is live here from now."""
        parts = self._parts()
        validate.request_id(request_id, parts.limits)
        resolved = validate.sample_count(n, parts.limits)
        session = session_of(context.invocation_metadata())
        if session:
            parts.sessions.touch(session)
        return parts, resolved

    def _prepare(
        self,
        parts: DataPlaneParts,
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
            spec = chat_convert.chat_spec(chat, sampling)
            adjustments, parsing = parts.chat_parsers.prepare(spec, prompt_token_ids, n)
            sampling = chat_convert.adjusted(sampling, adjustments)
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
        adapter = parts.adapters.begin(lora)
        messages = RequestMessages(
            StreamConverter(
                request_id,
                prompt_token_ids,
                params,
                include_text,
                routed_experts=sampling.return_routed_experts,
                routed_experts_as_sets=sampling.routed_experts_as_sets,
            ),
            ChunkCoalescer(stream_interval),
            lambda: parts.weights.version,
            adapter.version if adapter is not None else 0,
            parsing,
        )
        return PreparedRequest(
            request_id, prompt_token_ids, params, n, messages, adapter, tracing.headers()
        )

    async def _stream(
        self, parts: DataPlaneParts, prepared: PreparedRequest
    ) -> AsyncIterator[data_plane_pb2.GenerateStreamResponse]:
        try:
            async with self._admission.admit(prepared.n):
                parts.weights.generation_starts()
                outputs = parts.engine.generate(
                    prepared.request_id,
                    prepared.prompt_token_ids,
                    prepared.params,
                    prepared.messages,
                    prepared.adapter,
                    parts.weights.cache_salt,
                    prepared.trace_headers,
                )
                async for messages in outputs:
                    # More than one when this reader fell behind: it gets them merged.
                    for message in merge_backlog(messages):
                        yield message
        finally:
            parts.adapters.end(prepared.adapter)

    def _prepare_generation(
        self, parts: DataPlaneParts, request: GenerateLike, n: int, stream_interval: int = 0
    ) -> PreparedRequest:
        """A Generate / GenerateStream request of ``n`` (checked) samples, checked and
        prepared."""
        prompt = validate.prompt(request.prompt_token_ids, parts.limits, "prompt_token_ids")
        if isinstance(request, data_plane_pb2.GenerateStreamRequest):
            validate.weight_floor(request.min_weight_version, parts.weights.version)
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
        parts = self._parts()
        batch = BatchRun(parts.engine, parts.weights, parts.adapters, self._admission)
        self._add_batch(parts, batch, request)
        batch.close()
        async for response in batch.responses():
            yield response  # type: ignore[misc]

    async def GenerateMultiplex(
        self,
        request_iterator: AsyncIterator[data_plane_pb2.GenerateMultiplexRequest],
        context: Context,
    ) -> AsyncIterator[data_plane_pb2.GenerateMultiplexResponse]:
        parts = self._parts()
        batch = BatchRun(
            parts.engine,
            parts.weights,
            parts.adapters,
            self._admission,
            data_plane_pb2.GenerateMultiplexResponse,
        )

        async def read() -> None:
            try:
                async for message in request_iterator:
                    adding = message.HasField("add")
                    if adding and not self._refused_while_draining(batch, message):
                        if message.trace_context and tracing.enabled():
                            # The caller's span of the request, passed in the message: the
                            # call's metadata is shared by every request on it.
                            name = f"{GENERATE_STREAM} (multiplexed)"
                            with tracing.server_span(name, message.trace_context):
                                self._add_batch(parts, batch, message.add, bounded=False)
                        else:
                            self._add_batch(parts, batch, message.add, bounded=False)
                    for index in message.cancel:
                        batch.cancel(index)
            except Exception as error:  # a malformed message: the call ends with its status
                batch.fail(error)
            finally:
                batch.close()

        reading = asyncio.ensure_future(read())
        self._multiplexed.add(batch)
        try:
            async for response in batch.responses():
                yield response  # type: ignore[misc]
        finally:
            self._multiplexed.discard(batch)
            reading.cancel()

    def _refused_while_draining(
        self, batch: BatchRun, message: data_plane_pb2.GenerateMultiplexRequest
    ) -> bool:
        """Whether the server drains (``parts`` UNAVAILABLE), each request of ``message``
        then refused with that."""
        try:
            self._parts()
        except SkyrlError as error:
            indices, _ = validate.batch(message.add, None)
            for index in indices:
                batch.refuse(index, error)
            return True
        return False

    def _add_batch(
        self,
        parts: DataPlaneParts,
        batch: BatchRun,
        request: data_plane_pb2.GenerateBatchRequest,
        bounded: bool = True,
    ) -> None:
        """Each request of ``request`` checked, prepared and added to ``batch``, or refused
        there; a malformed batch (its shape; ``bounded``: more requests than the server holds)
        is refused whole. A multiplexed call's adds are not bounded: a caller merges the
        requests opened while it wrote into one message, each then admitted as if alone."""
        capacity = self._admission.capacity if bounded else None
        indices, sessions = validate.batch(request, capacity)
        batch.check_unused(indices)
        for index, item, session in zip(indices, request.requests, sessions, strict=True):
            try:
                validate.request_id(item.request_id, parts.limits)
                n = validate.sample_count(item.n, parts.limits)
                if session:
                    parts.sessions.touch(session)
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
        parts: DataPlaneParts,
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
        parts = self._parts()
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
        parts: DataPlaneParts,
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
            chat_convert.message_dicts(messages),
            add_generation_prompt,
            chat_convert.tool_dicts(tools) if tools else None,
        )
        return validate.prompt(rendered, parts.limits, "the rendered chat prompt")

    async def Detokenize(
        self, request: data_plane_pb2.DetokenizeRequest, context: Context
    ) -> data_plane_pb2.DetokenizeResponse:
        parts = self._parts()
        validate.token_ids(request.token_ids, parts.limits, "token_ids")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return data_plane_pb2.DetokenizeResponse(
            text=parts.tokenizer.decode(request.token_ids, skip)
        )

    async def GetTokenizer(
        self, request: data_plane_pb2.GetTokenizerRequest, context: Context
    ) -> data_plane_pb2.GetTokenizerResponse:
        return data_plane_pb2.GetTokenizerResponse(
            tokenizer_json=self._parts().tokenizer.serialized()
        )

    async def GetModelInfo(
        self, request: data_plane_pb2.GetModelInfoRequest, context: Context
    ) -> data_plane_pb2.GetModelInfoResponse:
        return convert.model_info_to_proto(self._parts().describe_model())

    async def Abort(
        self, request: data_plane_pb2.AbortRequest, context: Context
    ) -> data_plane_pb2.AbortResponse:
        aborted = await self._parts().engine.abort(list(request.request_ids))
        return data_plane_pb2.AbortResponse(aborted_request_ids=aborted)

    async def FinishSession(
        self, request: data_plane_pb2.FinishSessionRequest, context: Context
    ) -> data_plane_pb2.FinishSessionResponse:
        validate.session_id(request.session_id)
        parts = self._parts()
        found = parts.sessions.finish(request.session_id)
        return data_plane_pb2.FinishSessionResponse(found=found)
