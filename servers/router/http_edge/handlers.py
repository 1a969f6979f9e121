"""The OpenAI-compatible HTTP API: each endpoint's handler, over the router's own forwarding
path.

Every HTTP request becomes DataPlane calls made through ``Proxy`` -- the same path gRPC callers
take -- so placement (``x-session-id`` from the ``X-Session-ID`` header or a ``session_id`` body
field), retries before the first token, mid-stream migration, metrics and cancellation are the
router's, not a second implementation. Requests are read by ``parse``, answers built by
``render``; the ASGI plumbing (``asgi``) cancels a handler whose client went away, and with it
the generation upstream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any

import grpc

from servers.router.backends import BackendPool
from servers.router.fleet_view import fleet_view
from servers.router.http_edge import parse, render, stream_events, token_generate
from servers.router.http_edge.asgi import AsgiApp, Request, Responder
from servers.router.http_edge.fleet_page import FLEET_HTML
from servers.router.http_edge.http_status import error_body
from servers.router.http_edge.local_tokenizer import LocalTokenizer
from servers.router.http_edge.token_texts import TokenTexts
from servers.router.proxy import Proxy
from skyrl_grpc.concurrency import all_or_cancel
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.metadata import SESSION_ID
from skyrl_grpc.names import (
    DETOKENIZE,
    GET_MODEL_INFO,
    GET_TOKENIZER,
    TOKENIZE,
)
from skyrl_grpc.sample_assembly import ResponseAssembler
from skyrl_grpc.v1 import chat_tools_pb2, data_plane_pb2
from skyrl_grpc.v1 import generation_pb2 as gen

# Tokens per stream message for whole (non-streamed) answers: the server sends the first
# token and the end, little in between.
WHOLE = 1 << 16


class OpenAIEdge(AsgiApp):
    """The OpenAI API as an ASGI app. ``stream_interval``: tokens per upstream message for
    streamed answers (1: an event per engine step, as vLLM's server sends them)."""

    def __init__(
        self,
        proxy: Proxy,
        pool: BackendPool,
        stream_interval: int = 1,
        replica: int | None = None,
        tokenizer: LocalTokenizer | None = None,
        routed_experts: bool = False,
    ) -> None:
        self.proxy = proxy
        self.pool = pool
        self.stream_interval = stream_interval
        self.replica = replica
        # Text prompts tokenized here (the model's tokenizer files), else by a Tokenize call.
        self.tokenizer = tokenizer
        # Whole answers carry their routed experts (the servers capture them), as vLLM's do.
        self.routed_experts = routed_experts
        self._model: data_plane_pb2.GetModelInfoResponse | None = None
        self._token_texts = TokenTexts()  # for logprobs answers, as vLLM's server writes them
        super().__init__(
            {
                ("POST", "/v1/completions"): self.completions,
                ("POST", "/v1/chat/completions"): self.chat_completions,
                ("POST", "/v1/chat/completions/render"): self.render_chat,
                ("POST", "/inference/v1/generate"): self.generate_tokens,
                ("GET", "/v1/models"): self.models,
                ("GET", "/health"): self.health,
                ("GET", "/fleet"): self.fleet_page,
                ("GET", "/fleet.json"): self.fleet,
                ("POST", "/tokenize"): self.tokenize,
                ("POST", "/detokenize"): self.detokenize,
                ("POST", "/finish_session"): self.finish_session,
                ("POST", "/v1/finish_session"): self.finish_session,  # for SDKs rooted at /v1
            },
            observe=proxy.metrics.http_request,
        )

    # -- calls on the forwarding path --------------------------------------------------------

    async def _unary(self, method: str, message: Any, request: Request) -> bytes:
        return await self.proxy.unary_unary(method, message.SerializeToString(), request.call())

    async def _tokenizer_json(self, request: Request) -> str:
        """The servers' tokenizer as tokenizers' JSON (GetTokenizer on one of them)."""
        raw = await self._unary(GET_TOKENIZER, data_plane_pb2.GetTokenizerRequest(), request)
        return data_plane_pb2.GetTokenizerResponse.FromString(raw).tokenizer_json

    async def _model_info(
        self, request: Request, fresh: bool = False
    ) -> data_plane_pb2.GetModelInfoResponse:
        """The served model's facts: cached, or asked again (``fresh``: adapters change)."""
        if self._model is None or fresh:
            raw = await self._unary(GET_MODEL_INFO, data_plane_pb2.GetModelInfoRequest(), request)
            self._model = data_plane_pb2.GetModelInfoResponse.FromString(raw)
        return self._model

    async def _texts(
        self,
        logprobs: gen.Logprobs | None,
        sampled: Sequence[int],
        request: Request,
        before: Sequence[int] = (),
    ) -> render.PositionTexts:
        """The texts a logprobs answer names at each position of ``sampled`` (none without
        logprobs), as vLLM's server writes them (``token_texts``): decoded here by the
        router's tokenizer once it decodes as the servers do, else by a server."""
        if logprobs is None:
            return []

        async def remote(token_ids: Sequence[int]) -> str:
            raw = await self._unary(
                DETOKENIZE,
                data_plane_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=False),
                request,
            )
            return data_plane_pb2.DetokenizeResponse.FromString(raw).text

        async def decode(token_ids: Sequence[int]) -> str:
            if self.tokenizer is not None:
                fetch = partial(self._tokenizer_json, request)
                local = await self.tokenizer.decode(token_ids, remote, fetch)
                if local is not None:
                    return local
            return await remote(token_ids)

        return await self._token_texts.at_positions(sampled, before, logprobs, decode)

    async def _prompt_ids(self, call: parse.GenerationCall, request: Request) -> list[list[int]]:
        async def remote(text: str | None, special: bool = True) -> list[int]:
            tokenize = call.tokenize_request(text)
            if text is not None and not call.chat:
                tokenize.add_special_tokens = special
            raw = await self._unary(TOKENIZE, tokenize, request)
            return list(data_plane_pb2.TokenizeResponse.FromString(raw).token_ids)

        async def ids(prompt: list[int] | str | None) -> list[int]:
            if isinstance(prompt, list):
                return prompt
            if isinstance(prompt, str) and self.tokenizer is not None and not call.lora:
                local = await self.tokenizer.encode(
                    prompt, call.add_special_tokens, remote, partial(self._tokenizer_json, request)
                )
                if local is not None:
                    return local
            return await remote(prompt, call.add_special_tokens)

        if call.chat:
            return [await ids(None)]
        return await all_or_cancel(ids(p) for p in call.prompts)

    def _stream(
        self,
        prompt: list[int],
        call: parse.GenerationCall,
        request: Request,
        interval: int,
        offset: int = 0,
    ) -> AsyncIterator[data_plane_pb2.GenerateStreamResponse]:
        """One prompt's generation through the router's path, its step messages parsed."""
        # Chat outputs are parsed by the engine (tool calls, reasoning): once per sample for
        # whole answers, as deltas for streamed ones.
        chat_output = (
            chat_tools_pb2.ChatOutput(tool_use=call.tool_use, whole_messages=interval == WHOLE)
            if call.chat
            else None
        )
        message = data_plane_pb2.GenerateStreamRequest(
            # One id per prompt, as vLLM's server names them: two prompts of one request on
            # one server must not collide there.
            request_id=f"{call.id}-{offset}",
            prompt_token_ids=prompt,
            sampling_params=call.sampling,
            n=call.n,
            include_text=True,
            stream_interval=interval,
            lora=call.lora,
            chat_output=chat_output,
        )
        if self.routed_experts and interval == WHOLE:  # vLLM's streams do not carry them
            message.sampling_params.return_routed_experts = True
        return self.proxy.generation(message, request.call())

    async def _fold(
        self, prompt: list[int], call: parse.GenerationCall, request: Request, offset: int = 0
    ) -> ResponseAssembler:
        """One prompt's whole answer: its stream folded as every whole answer is."""
        assembler = ResponseAssembler()
        async for message in self._stream(prompt, call, request, WHOLE, offset):
            assembler.add(message)
        return assembler

    async def _relay(
        self,
        answer: stream_events.Answer,
        prompts: list[list[int]],
        request: Request,
        responder: Responder,
    ) -> None:
        """A streamed answer: each step's events written as ``answer`` makes them, then the
        end. One failing prompt cancels the others' relays (and their generations) before the
        error event and [DONE] are written: nothing writes after the end."""
        call = answer.call

        async def relay(offset: int, prompt: list[int]) -> None:
            async for message in self._stream(prompt, call, request, self.stream_interval, offset):
                texts: render.PositionTexts = ()
                if answer.wants_texts and message.HasField("logprobs"):
                    index = offset + message.sample_index
                    before = answer.sent(index)
                    texts = await self._texts(message.logprobs, message.token_ids, request, before)
                data = answer.step(message, offset, prompt, texts)
                if data:
                    await responder.events(data)

        if len(prompts) == 1:
            await relay(0, prompts[0])
        else:
            await all_or_cancel(relay(i * call.n, p) for i, p in enumerate(prompts))
        await responder.done(answer.end())

    # -- generation --------------------------------------------------------------------------

    async def completions(self, request: Request, responder: Responder) -> None:
        await self._generate(parse.read_generation(request.body, chat=False), request, responder)

    async def chat_completions(self, request: Request, responder: Responder) -> None:
        await self._generate(parse.read_generation(request.body, chat=True), request, responder)

    async def _generate(
        self, call: parse.GenerationCall, request: Request, responder: Responder
    ) -> None:
        await self._resolve_model(call, request)
        prompts = await self._prompt_ids(call, request)
        if len(prompts) > 1 and call.chat:
            raise InvalidArgument("chat takes one conversation")
        if call.stream:
            await self._relay(stream_events.StreamedAnswer(call), prompts, request, responder)
        else:
            await self._whole(call, prompts, request, responder)

    async def _whole(
        self,
        call: parse.GenerationCall,
        prompts: list[list[int]],
        request: Request,
        responder: Responder,
    ) -> None:
        async def one(offset: int, prompt: list[int]) -> tuple[list[render.SampleOut], gen.Usage]:
            assembler = await self._fold(prompt, call, request, offset)
            samples = [
                render.sample_out(s, call, offset, assembler.chat_messages.get(s.index))
                for s in assembler.samples()
            ]
            return samples, assembler.usage

        outcomes = await all_or_cancel(one(i * call.n, p) for i, p in enumerate(prompts))
        choices = [
            render.choice(
                call, sample, await self._texts(sample.logprobs, sample.token_ids, request), prompt
            )
            for (samples, _), prompt in zip(outcomes, prompts, strict=True)
            for sample in samples
        ]
        usage = render.usage_of(u for _, u in outcomes)
        await responder.json(200, render.response(call, choices, usage, prompts[0]))

    # -- vLLM's token-in / token-out endpoints ---------------------------------------------

    async def _resolve_model(self, call: parse.GenerationCall, request: Request) -> None:
        """``call.model``: the served name, or a LoRA adapter's (the engine checks the name
        as the generation starts: an unknown one is its NOT_FOUND, answered 404)."""
        model = await self._model_info(request)
        if call.model and call.model != model.served_model_name:
            call.lora = call.model
        else:
            call.model = model.served_model_name

    async def generate_tokens(self, request: Request, responder: Responder) -> None:
        """vLLM's ``/inference/v1/generate``: token ids in, token ids (and logprobs, weight
        versions) out, whole or streamed."""
        call = token_generate.read_generate(request.body)
        await self._resolve_model(call, request)
        (prompt,) = call.prompts
        assert isinstance(prompt, list)
        if call.stream:
            await self._relay(stream_events.TokenStream(call), [prompt], request, responder)
            return
        assembler = await self._fold(prompt, call, request)
        choices = []
        for sample in assembler.samples():
            finish, stop_reason, _ = render.finish_of(sample.finish_reason, sample.stop, "", call)
            choices.append(token_generate.choice(sample, finish, stop_reason, sample.index))
        usage_ = render.usage_of([assembler.usage])
        await responder.json(
            200, token_generate.response(call, choices, usage_, call.created, prompt)
        )

    async def render_chat(self, request: Request, responder: Responder) -> None:
        """vLLM's ``/v1/chat/completions/render``: the chat request as the token-in request
        that serves it (the template applied with its tools, nothing generated)."""
        call = parse.read_generation(request.body, chat=True)
        await self._resolve_model(call, request)
        (prompt,) = await self._prompt_ids(call, request)
        await responder.json(200, token_generate.render_response(call, prompt))

    # -- the rest ----------------------------------------------------------------------------

    async def models(self, request: Request, responder: Responder) -> None:
        model = await self._model_info(request, fresh=True)
        await responder.json(200, render.models(model, created=0))

    async def health(self, request: Request, responder: Responder) -> None:
        if self.pool.serving():
            await responder.json(200, {})
        else:
            status, body = error_body(grpc.StatusCode.UNAVAILABLE, "router: no healthy backend")
            await responder.json(status, body)

    async def fleet_page(self, request: Request, responder: Responder) -> None:
        await responder.page(FLEET_HTML, b"text/html; charset=utf-8")

    async def fleet(self, request: Request, responder: Responder) -> None:
        await responder.json(200, fleet_view(self.pool, self.proxy.events, self.replica))

    async def tokenize(self, request: Request, responder: Responder) -> None:
        raw = await self._unary(TOKENIZE, parse.read_tokenize(request.body), request)
        tokens = list(data_plane_pb2.TokenizeResponse.FromString(raw).token_ids)
        model = await self._model_info(request)
        await responder.json(
            200,
            {
                "count": len(tokens),
                "max_model_len": model.max_context_length,
                "tokens": tokens,
                "token_strs": None,
            },
        )

    async def detokenize(self, request: Request, responder: Responder) -> None:
        raw = await self._unary(DETOKENIZE, parse.read_detokenize(request.body), request)
        text = data_plane_pb2.DetokenizeResponse.FromString(raw).text
        await responder.json(200, {"prompt": text})

    async def finish_session(self, request: Request, responder: Responder) -> None:
        session = dict(request.metadata).get(SESSION_ID)
        if not session:
            raise InvalidArgument("name the session: 'session_id' in the body or X-Session-ID")
        message = data_plane_pb2.FinishSessionRequest(session_id=session)
        raw = await self.proxy.finish_session_everywhere(
            message.SerializeToString(), request.call()
        )
        found = data_plane_pb2.FinishSessionResponse.FromString(raw).found
        await responder.json(200, {"session_id": session, "found": found})
