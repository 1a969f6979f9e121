"""The data plane of the client: generations (streamed, whole, batched, n samples, chat and
text completion), tokenization, model info and sessions.

Generations go straight to the server the router's policy picks (``trainer_client.direct``),
or through the router; ``_attempt`` is the one path a generation's stream takes either way.
``generate`` adds what a trainer wants on top: resubmission after an abort (``abort_retry``)
and failover when a directly used server dies.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from skyrl_grpc import tracing
from skyrl_grpc.errors import server_lost
from skyrl_grpc.v1 import chat_tools_pb2, data_plane_pb2, generation_pb2
from skyrl_grpc.v1 import control_plane_pb2 as cp
from trainer_client.abort_retry import AbortRetry
from trainer_client.batches import BatchCalls, BatchGeneration
from trainer_client.client_core import ClientCore
from trainer_client.config import DEFAULT, Timeout
from trainer_client.exceptions import ServerError
from trainer_client.fleet_info import ModelInfo, ServerInfo, refuse_unless_all
from trainer_client.results import GenerationResult
from trainer_client.sampling import Message, Sampling, chat_messages, sampling_params
from trainer_client.stream_calls import open_stream
from trainer_client.tool_use import AssistantMessage, Tool, ToolChoice, tool_use

log = logging.getLogger(__name__)
T = TypeVar("T")
# How long a fleet found to capture routed experts is not asked again (a server restarted with
# other flags in that time is refused by the server itself).
EXPERTS_CHECK_SECONDS = 30.0


class Generation:
    """Data-plane calls (``InferenceClient.generation``). ``timeout``: seconds for the call
    (None: no deadline; ``DEFAULT``: ``ClientConfig.data_timeout``)."""

    def __init__(self, core: ClientCore) -> None:
        self._core = core
        self.config = core.config
        # The servers last found to capture routed experts, and when (``_check_experts``).
        self._experts_checked: tuple[tuple[str, ...], float] | None = None

    async def _check_experts(self, params: generation_pb2.SamplingParams) -> None:
        """A generation asking for its routed experts is refused (``Unsupported``, naming each
        server and the flag it lacks) before it is sent, where a server cannot capture them;
        the fleet's answer is kept for ``EXPERTS_CHECK_SECONDS``. A client given no servers
        leaves the refusal to the server it reaches."""
        if not params.return_routed_experts:
            return
        servers = tuple(await self._core.control_servers())
        checked = self._experts_checked
        now = time.monotonic()
        if not servers or (
            checked is not None
            and checked[0] == servers
            and now - checked[1] < EXPERTS_CHECK_SECONDS
        ):
            return
        infos = await self._core.fan_out(
            lambda s: s.GetServerInfo,
            cp.GetServerInfoRequest(),
            DEFAULT,
            ServerInfo.from_proto,
        )
        refuse_unless_all(
            "return_routed_experts", infos, lambda i: i.capabilities.cannot_return_routed_experts()
        )
        self._experts_checked = (servers, now)

    async def _target(
        self, session_id: str | None, tried: set[str], min_version: int = 0
    ) -> str | None:
        """The server a generation goes to directly, or None to go through the router (also
        when no server the client sees serves ``min_version``: the router holds it for one)."""
        if not self.config.direct:
            return None
        routes = self._core.connections.routes()
        if not await routes.ready():
            return None
        return routes.pick(session_id, tried, min_version)

    async def _attempt(
        self,
        request: data_plane_pb2.GenerateStreamRequest,
        session_id: str | None,
        tried: set[str],
        timeout: Timeout,
    ) -> AsyncGenerator[data_plane_pb2.GenerateStreamResponse, None]:
        """One stream of one generation, directly to a server (over its multiplexed call:
        ``stream_calls``) or through the router. A server used directly that turns out gone
        is marked unavailable and added to ``tried`` before its ``Unavailable`` is raised, so
        the caller may move on elsewhere; a router whose connection broke is added too (the
        caller goes on through the same address)."""
        target = await self._target(session_id, tried, request.min_weight_version)
        address = target or self.config.router
        deadline = self._core.deadline("data", timeout)
        metadata = self._core.metadata("data", session_id)
        call = open_stream(self._core, target, request, deadline, metadata)
        routes = self._core.connections.routes() if target is not None else None
        if routes is not None and target is not None:
            routes.begin(target)
        try:
            async with contextlib.aclosing(call.chunks()) as chunks:
                async for chunk in chunks:
                    yield chunk
        except grpc.aio.AioRpcError as error:
            if server_lost(error):
                if routes is not None and target is not None:
                    routes.mark_unavailable(target)
                    tried.add(target)
                else:
                    # The router's connection broke (a replica died, or the router restarted):
                    # the same address reaches a router that lives, so the caller goes on there.
                    tried.add(f"{address} (connection lost, {len(tried) + 1})")
            raise ServerError.from_rpc_error(address, error) from error
        finally:
            call.cancel()
            if routes is not None and target is not None:
                routes.end(target)

    async def stream(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        n: int = 1,
        include_text: bool = False,
        request_id: str = "",
        stream_interval: int | None = None,
        lora: str = "",
        timeout: Timeout = DEFAULT,
    ) -> AsyncGenerator[data_plane_pb2.GenerateStreamResponse, None]:
        """The raw stream of one generation, chunks as the server sends them (no retry on
        abort, no failover).

        ``stream_interval``: tokens per message after the first (None: ``ClientConfig``'s;
        0: one per engine step); larger values trade per-token latency for throughput.
        """
        params = sampling_params(sampling)
        await self._check_experts(params)
        request = data_plane_pb2.GenerateStreamRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            n=n,
            include_text=include_text,
            stream_interval=(
                self.config.stream_interval if stream_interval is None else stream_interval
            ),
            lora=lora,
        )
        async with contextlib.aclosing(self._attempt(request, session_id, set(), timeout)) as it:
            async for chunk in it:
                yield chunk

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        include_text: bool = False,
        lora: str = "",
        timeout: Timeout = DEFAULT,
    ) -> GenerationResult:
        """One sample, resubmitted after aborts (pause for a weight update) until finished.
        ``lora``: the adapter to generate with (``load_lora``); empty: the base model.

        One rule for aborts: a sample still aborted when ``max_abort_retries`` resubmissions
        are used up (0: none) is returned as it is, ``finish_reason`` ABORTED, with the tokens
        generated so far and ``abort_retries``; it is never raised, so one sample cannot
        fail a batch. ``timeout`` bounds each attempt."""
        return await self._generate(
            prompt_token_ids, sampling, session_id, include_text, lora, timeout
        )

    async def _generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        session_id: str | None,
        include_text: bool,
        lora: str,
        timeout: Timeout,
        chat_output: chat_tools_pb2.ChatOutput | None = None,
    ) -> GenerationResult:
        params = sampling_params(sampling)
        await self._check_experts(params)
        retry = AbortRetry(
            list(prompt_token_ids),
            params,
            include_text,
            self.config.max_abort_retries,
            self.config.stream_interval,
            lora,
            chat_output,
        )
        tried: set[str] = set()
        while True:
            gone_before = len(tried)
            try:
                attempt = self._attempt(retry.request(), session_id, tried, timeout)
                async with contextlib.aclosing(attempt) as chunks:
                    async for chunk in chunks:
                        retry.add(chunk)
            except ServerError as error:
                if len(tried) == gone_before or len(tried) > self.config.max_direct_failovers:
                    raise
                if retry.finished_by_budget():  # every token arrived, only the end was lost
                    break
                # The server is gone: go on elsewhere with the prompt plus the tokens so far
                # (before the first token, that is a plain retry).
                log.warning(
                    "server %s failed (%s): moving the generation", error.address, error.code.name
                )
                continue
            if not retry.should_resubmit():
                break
        result = GenerationResult.from_sample(
            list(prompt_token_ids), retry.sample(), params.HasField("logprobs"), retry.retries
        )
        result.cached_prompt_tokens = retry.cached_prompt_tokens
        if (message := retry.message()) is not None:
            result.message = AssistantMessage.from_proto(message)
        if include_text and retry.retries:
            # Text deltas split at a retry boundary may cut a multi-byte character: decode the
            # whole id sequence instead.
            result.text = await self.detokenize(result.token_ids)
        return result

    @tracing.traced("generate_batch")
    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling = None,
        *,
        session_ids: Sequence[str | None] | None = None,
        include_text: bool = False,
        lora: str = "",
        timeout: Timeout = DEFAULT,
    ) -> list[GenerationResult]:
        """Generates one sample for every prompt; results in input order. The batch travels
        as batched calls (``batches``): one GenerateBatch per server (or one to the router),
        each streaming a message per engine step for all of its prompts. Aborted samples are
        resubmitted as ``generate`` resubmits one. If one generation fails, the others are
        cancelled (their requests aborted on the servers) before its error is raised."""
        if session_ids is not None and len(session_ids) != len(prompts):
            raise ValueError(f"{len(session_ids)} session ids for {len(prompts)} prompts")
        if not prompts:
            return []
        sessions = session_ids or [None] * len(prompts)
        params = sampling_params(sampling)
        await self._check_experts(params)
        every = [params] * len(prompts)
        calls = self._batch_calls()
        batch = BatchGeneration(calls, prompts, every, sessions, include_text, lora, timeout)
        return await batch.run()

    def _batch_calls(self) -> BatchCalls:
        """What a ``BatchGeneration`` of this client uses."""
        return BatchCalls(
            config=self.config,
            target=self._target,
            stub=self._core.data,
            metadata=lambda: self._core.metadata("data"),
            routes=self._core.connections.routes,
            generate_one=self._generate,
            detokenize=self.detokenize,
        )

    @tracing.traced("sample")
    async def sample(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling = None,
        *,
        n: int,
        session_id: str | None = None,
        include_text: bool = False,
        lora: str = "",
        timeout: Timeout = DEFAULT,
    ) -> list[GenerationResult]:
        """``n`` independent samples of one prompt. Without a session they spread over servers
        by load; with one, they all go to the session's server (sharing its prefix cache). With
        a ``seed``, sample ``i`` is drawn with ``seed + i``, as vLLM seeds the ``n`` samples of
        one request: one seed n times would give the same sample n times."""
        if n < 1:
            return []
        params = sampling_params(sampling)
        await self._check_experts(params)
        copies = [params] * n
        if params.HasField("seed"):
            copies = [sampling_params(params, seed=params.seed + i) for i in range(n)]
        prompts, sessions = [prompt_token_ids] * n, [session_id] * n
        calls = self._batch_calls()
        batch = BatchGeneration(calls, prompts, copies, sessions, include_text, lora, timeout)
        return await batch.run()

    async def chat(
        self,
        messages: Sequence[Message],
        sampling: Sampling = None,
        *,
        tools: Sequence[Tool | Mapping[str, Any]] = (),
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool | None = None,
        session_id: str | None = None,
        lora: str = "",
        timeout: Timeout = DEFAULT,
    ) -> GenerationResult:
        """Chat completion: the model's chat template (showing ``tools``), then ``generate``
        (so aborts retry). ``result.message`` is the output as the servers parsed it: tool
        calls (``--tool-call-parser``), reasoning (``--reasoning-parser``), content.
        ``tool_choice``: "auto" (the default with tools), "none", "required" or
        ``CallFunction(name)``; the last two constrain the output to calls."""
        use = tool_use(tools, tool_choice, parallel_tool_calls)
        prompt = await self._render(messages, use.tools, session_id, timeout)
        chat = chat_tools_pb2.ChatOutput(tool_use=use, whole_messages=True)
        return await self._generate(prompt, sampling, session_id, True, lora, timeout, chat)

    async def complete(
        self,
        prompt: str,
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        lora: str = "",
        timeout: Timeout = DEFAULT,
    ) -> GenerationResult:
        """Text completion: tokenize, then ``generate`` (so aborts retry)."""
        tokens = await self.tokenize(prompt, session_id=session_id, timeout=timeout)
        return await self.generate(
            tokens, sampling, session_id=session_id, include_text=True, lora=lora, timeout=timeout
        )

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        add_special_tokens: bool = True,
        session_id: str | None = None,
        timeout: Timeout = DEFAULT,
    ) -> list[int]:
        """Token ids of ``text``, or of ``messages`` through the chat template."""
        if (text is None) == (messages is None):
            raise ValueError("pass exactly one of text and messages")
        if messages is not None:
            return await self._render(messages, (), session_id, timeout)
        request = data_plane_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return await self._tokenize(request, session_id, timeout)

    async def _render(
        self,
        messages: Sequence[Message],
        tools: Sequence[chat_tools_pb2.Tool],
        session_id: str | None,
        timeout: Timeout,
    ) -> list[int]:
        """The conversation through the chat template, as token ids."""
        conversation = data_plane_pb2.ChatConversation(
            messages=chat_messages(messages), tools=tools
        )
        request = data_plane_pb2.TokenizeRequest(conversation=conversation)
        return await self._tokenize(request, session_id, timeout)

    async def _tokenize(
        self, request: data_plane_pb2.TokenizeRequest, session_id: str | None, timeout: Timeout
    ) -> list[int]:
        response = await self._router_call(self._core.data().Tokenize, request, timeout, session_id)
        return list(response.token_ids)

    async def _router_call(
        self,
        call: Callable[..., Awaitable[T]],
        request: Any,
        timeout: Timeout,
        session_id: str | None = None,
    ) -> T:
        """One unary data-plane call through the router."""
        return await self._core.unary(
            self.config.router,
            call,
            request,
            self._core.deadline("data", timeout),
            session_id,
            plane="data",
        )

    async def detokenize(
        self,
        token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        timeout: Timeout = DEFAULT,
    ) -> str:
        request = data_plane_pb2.DetokenizeRequest(
            token_ids=list(token_ids), skip_special_tokens=skip_special_tokens
        )
        response = await self._router_call(self._core.data().Detokenize, request, timeout)
        return str(response.text)

    async def model_info(self, *, timeout: Timeout = DEFAULT) -> ModelInfo:
        """The served model: vocabulary, special tokens, context length, LoRA adapters."""
        request = data_plane_pb2.GetModelInfoRequest()
        response = await self._router_call(self._core.data().GetModelInfo, request, timeout)
        return ModelInfo.from_proto(response)

    async def finish_session(self, session_id: str, *, timeout: Timeout = DEFAULT) -> bool:
        """End a session: its server frees the session's place (and the router stops counting
        it), so new sessions can use it. True if a server held the session. Sessions that are
        never finished are released after the servers' ``--session-idle-seconds``."""
        request = data_plane_pb2.FinishSessionRequest(session_id=session_id)
        response = await self._router_call(self._core.data().FinishSession, request, timeout)
        return bool(response.found)
