"""A stand-in DataPlane backend for tests whose subject is the router or the client logic.

It "generates" token i at step i with a fixed delay per token, records what it saw (metadata,
deadlines, cancellations) and can be told to fail. Runs in-process (``FakeBackend``) or as a
process: ``python -m tests.helpers.fake_backend --port P [--host A]`` (for kill -9 tests, and on
a testbed host).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from servers.common.listener import ServerTls, bind, server_options
from skyrl_grpc import routed_experts
from skyrl_grpc.v1 import (
    data_plane_pb2,
    data_plane_pb2_grpc,
    generation_pb2,
    status_pb2,
    status_pb2_grpc,
)

DATA_PLANE = "skyrl.inference.v1.DataPlane"


@dataclass
class Observed:
    calls: int = 0
    in_flight: int = 0
    cancelled: int = 0
    completed: int = 0
    metadata: list[dict[str, str]] = field(default_factory=list)
    deadlines: list[float | None] = field(default_factory=list)
    finished_sessions: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # request ids an Abort named


class FakeDataPlane(data_plane_pb2_grpc.DataPlaneServicer):
    """``delay``: seconds per token. ``per_stream_delay``: extra seconds per token for every
    stream in flight, modelling batched decoding whose step time grows with the batch."""

    def __init__(self, name: str, delay: float, per_stream_delay: float = 0.0) -> None:
        self.name = name
        self.delay = delay
        self.per_stream_delay = per_stream_delay
        self.observed = Observed()
        self.fail_next_with: grpc.StatusCode | None = None
        self.fail_after_tokens: int | None = None
        # The status a stream told to fail mid-stream ends with (None: UNAVAILABLE, naming it).
        self.fail_mid_stream_with: tuple[grpc.StatusCode, str] | None = None
        # Ends every stream after this many tokens with FINISH_REASON_ABORTED, as a server
        # paused in ABORT mode does.
        self.abort_after_tokens: int | None = None
        # LoRA adapters it serves: a request naming another is NOT_FOUND, as on an engine.
        self.adapters: set[str] = set()
        # The routed experts ([tokens, layers, top-k]) a request that asks for them gets on its
        # last message, packed as the engine's converter packs vLLM's (None: it never asks);
        # or a function of the rows a request's array covers (the prompt's from its
        # routed_experts_prompt_start, then the output's but the last) that makes them.
        self.routed_experts: Any = None
        # Whether each request asked for its routed experts.
        self.asked_experts: list[bool] = []
        # The callers' request ids running now: another with one of them is ALREADY_EXISTS, as
        # on an engine. With ``orphan_on_failure``, a stream told to fail mid-stream leaves its
        # id running (a server cut off from its caller, which never saw the stream end) until
        # an Abort names it.
        self.running_ids: set[str] = set()
        self.orphan_on_failure = False
        # ``fail_after_tokens`` fails one stream only (the next ones run whole).
        self.fail_once = False
        # The weight version its tokens are stamped with; a request whose min_weight_version
        # is newer is refused FAILED_PRECONDITION, as on an engine (``set_version``).
        self.weight_version = 0

    def _begin(self, context: grpc.aio.ServicerContext) -> None:  # type: ignore[type-arg]
        self.observed.calls += 1
        self.observed.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})
        self.observed.deadlines.append(context.time_remaining())

    async def _tokens(
        self,
        request: data_plane_pb2.GenerateStreamRequest,
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> AsyncIterator[data_plane_pb2.GenerateStreamResponse]:
        self._begin(context)
        if self.fail_next_with is not None:
            code, self.fail_next_with = self.fail_next_with, None
            await context.abort(code, f"{self.name} told to fail")
        if request.lora and request.lora not in self.adapters:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {request.lora!r}"
            )
        if request.min_weight_version > self.weight_version:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{self.name} serves weight version {self.weight_version}, older than "
                f"min_weight_version {request.min_weight_version}",
            )
        max_tokens = request.sampling_params.max_tokens or 8
        asked = request.sampling_params.return_routed_experts
        self.asked_experts.append(asked)
        request_id = request.request_id
        if request_id in self.running_ids:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight"
            )
        if request_id:
            self.running_ids.add(request_id)
        orphaned = False
        self.observed.in_flight += 1
        try:
            for i in range(max_tokens):
                if self.fail_after_tokens is not None and i == self.fail_after_tokens:
                    orphaned = self.orphan_on_failure
                    if self.fail_once:
                        self.fail_after_tokens = None
                    await context.abort(
                        *(
                            self.fail_mid_stream_with
                            or (grpc.StatusCode.UNAVAILABLE, f"{self.name} failed mid-stream")
                        )
                    )
                if self.abort_after_tokens is not None and i == self.abort_after_tokens:
                    yield data_plane_pb2.GenerateStreamResponse(
                        request_id=request.request_id or self.name,
                        finish_reason=generation_pb2.FINISH_REASON_ABORTED,
                    )
                    return
                await asyncio.sleep(self.delay + self.per_stream_delay * self.observed.in_flight)
                last = i == max_tokens - 1
                chunk = data_plane_pb2.GenerateStreamResponse(
                    request_id=request.request_id or self.name,
                    token_ids=[i],
                    weight_version=self.weight_version,
                    finish_reason=(
                        generation_pb2.FINISH_REASON_LENGTH
                        if last
                        else generation_pb2.FINISH_REASON_UNSPECIFIED
                    ),
                    usage=generation_pb2.Usage(
                        prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1
                    ),
                )
                if last and asked and self.routed_experts is not None:
                    chunk.routed_experts.CopyFrom(self._experts_of(request, max_tokens))
                yield chunk
            self.observed.completed += 1
        except (asyncio.CancelledError, GeneratorExit):
            # A cancelled call ends here either way: CancelledError if grpc cancelled the call
            # while this generator awaited its sleep, GeneratorExit if it was cancelled while
            # grpc was sending a chunk (grpc then drops the generator, which is closed).
            self.observed.cancelled += 1
            raise
        finally:
            self.observed.in_flight -= 1
            if not orphaned:
                self.running_ids.discard(request_id)

    async def GenerateStream(self, request, context):  # type: ignore[no-untyped-def]
        async for chunk in self._tokens(request, context):
            yield chunk

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        stream_request = data_plane_pb2.GenerateStreamRequest.FromString(
            request.SerializeToString()
        )
        tokens = [t async for c in self._tokens(stream_request, context) for t in c.token_ids]
        return data_plane_pb2.GenerateResponse(
            request_id=request.request_id or self.name,
            samples=[
                generation_pb2.Sample(
                    token_ids=tokens, finish_reason=generation_pb2.FINISH_REASON_LENGTH
                )
            ],
        )

    async def GenerateBatch(self, request, context):  # type: ignore[no-untyped-def]
        """The batch's requests in lockstep, a message per step: a request whose id runs here
        is refused ALREADY_EXISTS alone; ``fail_after_tokens`` ends the whole call (leaving the
        ids running with ``orphan_on_failure``)."""
        self._begin(context)
        refused, running = [], []
        for index, asked in zip(request.indices, request.requests, strict=True):
            self.asked_experts.append(asked.sampling_params.return_routed_experts)
            if asked.request_id and asked.request_id in self.running_ids:
                message = f"request_id {asked.request_id!r} is already in flight"
                code = grpc.StatusCode.ALREADY_EXISTS.value[0]
                refused.append(data_plane_pb2.BatchError(index=index, code=code, message=message))
            else:
                if asked.request_id:  # empty: the server names it, as an engine does
                    self.running_ids.add(asked.request_id)
                running.append((index, asked))
        if refused:
            yield data_plane_pb2.GenerateBatchResponse(errors=refused)
        orphaned = False
        try:
            steps = max((a.sampling_params.max_tokens or 8 for _, a in running), default=0)
            for i in range(steps):
                if self.fail_after_tokens is not None and i == self.fail_after_tokens:
                    orphaned = self.orphan_on_failure
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} failed")
                await asyncio.sleep(self.delay)
                chunks = []
                for index, asked in running:
                    max_tokens = asked.sampling_params.max_tokens or 8
                    if i >= max_tokens:
                        continue
                    reason = (
                        generation_pb2.FINISH_REASON_LENGTH
                        if i == max_tokens - 1
                        else generation_pb2.FINISH_REASON_UNSPECIFIED
                    )
                    chunk = data_plane_pb2.GenerateStreamResponse(
                        request_id=asked.request_id, batch_index=index, token_ids=[i],
                        finish_reason=reason, weight_version=self.weight_version,
                        usage=generation_pb2.Usage(completion_tokens=i + 1),
                    )  # fmt: skip
                    wants = asked.sampling_params.return_routed_experts
                    if i == max_tokens - 1 and wants and self.routed_experts is not None:
                        chunk.routed_experts.CopyFrom(self._experts_of(asked, max_tokens))
                    chunks.append(chunk)
                yield data_plane_pb2.GenerateBatchResponse(chunks=chunks)
        finally:
            if not orphaned:
                self.running_ids.difference_update(asked.request_id for _, asked in running)

    def _experts_of(
        self, request: data_plane_pb2.GenerateStreamRequest, tokens: int
    ) -> generation_pb2.RoutedExperts:
        """The routed experts of ``request``'s sample of ``tokens`` tokens, packed as it asked."""
        sampling = request.sampling_params
        experts = self.routed_experts
        if callable(experts):
            start = sampling.routed_experts_prompt_start
            experts = experts(len(request.prompt_token_ids) - start + tokens - 1)
        return routed_experts.pack(experts, as_sets=sampling.routed_experts_as_sets)

    async def Abort(self, request, context):  # type: ignore[no-untyped-def]
        self.observed.aborted.extend(request.request_ids)
        aborted = [i for i in request.request_ids if i in self.running_ids]
        self.running_ids.difference_update(aborted)
        return data_plane_pb2.AbortResponse(aborted_request_ids=aborted)

    async def FinishSession(self, request, context):  # type: ignore[no-untyped-def]
        self.observed.finished_sessions.append(request.session_id)
        return data_plane_pb2.FinishSessionResponse(found=True)

    async def GetModelInfo(self, request, context):  # type: ignore[no-untyped-def]
        self._begin(context)
        return data_plane_pb2.GetModelInfoResponse(served_model_name=self.name, vocab_size=16)


class FakeStatus(status_pb2_grpc.ServerStatusServicer):
    """ServerStatus.Watch as an engine answers it, reporting only the weight version (sent
    at once, then at each ``FakeBackend.set_version``)."""

    def __init__(self, data_plane: FakeDataPlane) -> None:
        self._data_plane = data_plane
        self.changed = asyncio.Event()
        self.sampling_seed: int | None = None  # reported when set

    async def Watch(self, request, context):  # type: ignore[no-untyped-def]
        while True:
            self.changed.clear()
            yield status_pb2.WatchResponse(
                weight_version=self._data_plane.weight_version,
                sessions_complete=True,
                sampling_seed=self.sampling_seed,
            )
            await self.changed.wait()


class FakeBackend:
    """An in-process fake engine server with health; ``start()`` binds ``port`` (0: any).
    ``status``: it also serves ServerStatus (its weight version, for the router to follow)."""

    def __init__(
        self,
        name: str = "fake",
        delay: float = 0.002,
        port: int = 0,
        per_stream_delay: float = 0.0,
        status: bool = False,
        host: str = "127.0.0.1",
    ) -> None:
        # A stand-in: the DataPlane methods it does not serve answer UNIMPLEMENTED.
        self.servicer = FakeDataPlane(name, delay, per_stream_delay)  # type: ignore[abstract]
        self.status = FakeStatus(self.servicer) if status else None
        self.health = health.aio.HealthServicer()
        self.requested_port = port
        self.host = host
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def observed(self) -> Observed:
        return self.servicer.observed

    async def start(self, tls: ServerTls | None = None) -> FakeBackend:
        # The stack's own server options: a stand-in must accept the keepalive pings routers
        # and clients send, or it answers them with GOAWAY "too many pings" mid-test.
        self.server = grpc.aio.server(options=server_options())
        data_plane_pb2_grpc.add_DataPlaneServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.status is not None:
            status_pb2_grpc.add_ServerStatusServicer_to_server(self.status, self.server)
        self.port = bind(self.server, f"{self.host}:{self.port or self.requested_port}", tls)
        await self.server.start()
        await self.health.set(DATA_PLANE, health_pb2.HealthCheckResponse.SERVING)
        return self

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(DATA_PLANE, status)

    def set_version(self, version: int) -> None:
        """Serves weight ``version`` from now (and reports it, with ``status``)."""
        self.servicer.weight_version = version
        if self.status is not None:
            self.status.changed.set()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None


async def _main(port: int, name: str, delay: float, host: str) -> None:
    backend = await FakeBackend(name, delay, port, host=host).start()
    print(json.dumps({"event": "ready", "address": backend.address}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--delay", type=float, default=0.002)
    parser.add_argument("--host", default="127.0.0.1")  # a testbed host's address
    args = parser.parse_args()
    asyncio.run(_main(args.port, args.name, args.delay, args.host))
