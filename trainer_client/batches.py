"""A trainer's batch as batched calls: ``generate_batch`` sends GenerateBatch, not a stream per
sample.

With direct routing, each prompt is placed as its single generation would be (the router's own
policy, ``trainer_client.direct``: a session's prompts on its server) and each server gets its
part in one call, the prompts under their positions in the batch; through the router, the
router splits and merges. Every sample is one ``AbortRetry``: its chunks accumulate there, and
a call that ends leaves its samples either finished, or aborted (a pause in ABORT mode: they
are sent again at once, in one new call, each from its tokens so far), or cut by a server used
directly that died (they move elsewhere, as a single generation fails over, within
``max_direct_failovers`` servers each). A request the servers refuse fails the batch: the rest
is cancelled (aborted on the servers) before its error is raised. A server (or router) without
GenerateBatch, an older one, gets its part as single streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from skyrl_grpc.errors import server_lost, status_of
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc, generation_pb2
from trainer_client.abort_retry import AbortRetry
from trainer_client.config import ClientConfig, Timeout
from trainer_client.direct import DirectRoutes
from trainer_client.exceptions import ServerError
from trainer_client.results import GenerationResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchCalls:
    """What a batch uses of its client, as plain callables (the client's ``Generation`` builds
    it): where a prompt goes, a stub and metadata for a call, the routing view, one sample's
    generation (a server without GenerateBatch), detokenization."""

    config: ClientConfig
    # The server a prompt goes to directly (None: through the router), given those it failed on.
    target: Callable[[str | None, set[str]], Awaitable[str | None]]
    stub: Callable[[str], data_plane_pb2_grpc.DataPlaneAsyncStub]
    metadata: Callable[[], tuple[tuple[str, str], ...]]
    routes: Callable[[], DirectRoutes]
    # One prompt as one stream: (prompt, params, session, include_text, lora, timeout).
    generate_one: Callable[
        [Sequence[int], generation_pb2.SamplingParams, str | None, bool, str, Timeout],
        Awaitable[GenerationResult],
    ]
    detokenize: Callable[[Sequence[int]], Awaitable[str]]


class BatchGeneration:
    """One ``generate_batch`` (see the module docstring)."""

    def __init__(
        self,
        calls: BatchCalls,
        prompts: Sequence[Sequence[int]],
        params: Sequence[generation_pb2.SamplingParams],
        sessions: Sequence[str | None],
        include_text: bool,
        lora: str,
        timeout: Timeout,
    ) -> None:
        self._uses = calls
        config = calls.config
        self._prompts = [list(p) for p in prompts]
        self._sessions = list(sessions)
        self._params = list(params)  # each prompt's own
        self._include_text = include_text
        self._lora = lora
        self._timeout = config.timeout("data", timeout)
        self._samples = [
            AbortRetry(
                prompt, own, include_text, config.max_abort_retries, config.stream_interval, lora
            )
            for prompt, own in zip(self._prompts, self._params, strict=True)
        ]
        # Servers each prompt's calls failed on, used directly (skipped for it from then).
        self._tried: list[set[str]] = [set() for _ in self._prompts]
        # Prompts a server without GenerateBatch generated as single streams.
        self._single: dict[int, GenerationResult] = {}
        self._calls: set[asyncio.Task[None]] = set()

    async def run(self) -> list[GenerationResult]:
        """Every prompt's sample, in order."""
        try:
            await self._send(list(range(len(self._prompts))))
            while self._calls:
                done, _ = await asyncio.wait(self._calls, return_when=asyncio.FIRST_COMPLETED)
                self._calls -= done
                for call in done:
                    call.result()  # the first failure is raised (the rest cancelled below)
        finally:
            for call in self._calls:
                call.cancel()
            await asyncio.gather(*self._calls, return_exceptions=True)
        return await self._results()

    async def _results(self) -> list[GenerationResult]:
        results = []
        for index, (prompt, sample) in enumerate(zip(self._prompts, self._samples, strict=True)):
            result = self._single.get(index)
            if result is None:
                result = GenerationResult.from_sample(
                    prompt,
                    sample.sample(),
                    self._params[index].HasField("logprobs"),
                    sample.retries,
                )
                result.cached_prompt_tokens = sample.cached_prompt_tokens
            results.append(result)
        if self._include_text:
            # Text deltas split at a retry boundary may cut a multi-byte character: decode
            # the whole id sequence of every resubmitted sample instead.
            retried = [
                r for i, r in enumerate(results) if i not in self._single and r.abort_retries
            ]
            texts = await asyncio.gather(*(self._uses.detokenize(r.token_ids) for r in retried))
            for result, text in zip(retried, texts, strict=True):
                result.text = text
        return results

    def _spawn(self, call: Coroutine[Any, Any, None]) -> None:
        self._calls.add(asyncio.ensure_future(call))

    async def _send(self, indices: list[int]) -> None:
        """Sends these prompts (each from where it is) as one call per server."""
        parts: dict[str | None, list[int]] = defaultdict(list)
        for index in indices:
            target = await self._uses.target(self._sessions[index], self._tried[index])
            parts[target].append(index)
        for target, part in parts.items():
            self._spawn(self._call(target, part))

    async def _call(self, target: str | None, indices: list[int]) -> None:
        """One GenerateBatch call (to ``target`` directly, or to the router when None); then
        what it left to do is sent again."""
        address = target or self._uses.config.router
        request = data_plane_pb2.GenerateBatchRequest(
            requests=[self._samples[i].request() for i in indices],
            session_ids=[self._sessions[i] or "" for i in indices],
            indices=indices,
        )
        routes = self._uses.routes() if target is not None else None
        if routes is not None and target is not None:
            for _ in indices:
                routes.begin(target)
        call = self._uses.stub(address).GenerateBatch(
            request, timeout=self._timeout, metadata=self._uses.metadata()
        )
        try:
            async for message in call:
                for chunk in message.chunks:
                    self._samples[chunk.batch_index].add(chunk)
                for error in message.errors:
                    status = status_of(error.code)
                    detail = f"prompt {error.index} of the batch: {error.message}"
                    raise ServerError.of(address, status, detail)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                await self._as_single_streams(indices)
                return
            if target is None or not server_lost(error):
                raise ServerError.from_rpc_error(address, error) from error
            await self._fail_over(target, indices, error)
            return
        finally:
            call.cancel()
            if routes is not None and target is not None:
                for _ in indices:
                    routes.end(target)
        again = [i for i in indices if self._samples[i].should_resubmit()]
        if again:
            await self._send(again)

    async def _fail_over(
        self, target: str, indices: list[int], error: grpc.aio.AioRpcError
    ) -> None:
        """A server used directly is gone: its unfinished prompts go on elsewhere, each from
        its tokens so far (before its first token, that is a plain retry)."""
        self._uses.routes().mark_unavailable(target)
        moving = []
        for index in indices:
            sample = self._samples[index]
            finish = sample.sample().finish_reason
            # A sample with every token of its budget is finished (only its end was lost).
            unfinished = finish == generation_pb2.FINISH_REASON_UNSPECIFIED
            if (unfinished and not sample.finished_by_budget()) or sample.should_resubmit():
                self._tried[index].add(target)
                if len(self._tried[index]) > self._uses.config.max_direct_failovers:
                    raise ServerError.from_rpc_error(target, error) from error
                moving.append(index)
        log.warning(
            "server %s failed (%s): moving %d generations", target, error.code().name, len(moving)
        )
        await self._send(moving)

    async def _as_single_streams(self, indices: list[int]) -> None:
        """A server without GenerateBatch (an older one): these prompts as single streams."""
        results = await asyncio.gather(
            *(
                self._uses.generate_one(
                    self._prompts[i],
                    self._params[i],
                    self._sessions[i],
                    self._include_text,
                    self._lora,
                    self._timeout,
                )
                for i in indices
            )
        )
        self._single.update(zip(indices, results, strict=True))
