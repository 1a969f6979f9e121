"""``InferenceClient``: what a trainer uses to generate and to control the fleet (asyncio API).

Data-plane calls go to the router (``x-session-id`` keeps a conversation on one server);
control-plane calls fan out to every server directly and concurrently. The client holds only
its ``ClientConfig``: channels open lazily, per process and event loop, and are never pickled,
so a client can be handed to Ray actors and subprocesses as is. ``BlockingInferenceClient``
(``trainer_client.blocking``) offers the same methods without ``await``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from skyrl_grpc.concurrency import all_or_cancel
from skyrl_grpc.metadata import SESSION_ID
from skyrl_grpc.names import PUSH_WEIGHTS
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import (
    control_plane_pb2_grpc,
    data_plane_pb2,
    data_plane_pb2_grpc,
    generation_pb2,
    lora_pb2,
)

from .config import ClientConfig
from .continuation import Continuation
from .direct import DirectRoutes
from .errors import ServerError
from .fanout import failures_of, fan_out
from .results import GenerationResult, WeightVersions
from .transport import Transport
from .weight_transaction import run_weight_transaction
from .weights import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    CollectiveSender,
    lora_push_messages,
    plan_buckets,
    push_messages,
    rank_offsets,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
Sampling = generation_pb2.SamplingParams | Mapping[str, Any] | None
Message = Mapping[str, str] | data_plane_pb2.ChatMessage

PAUSE_MODES = {
    "abort": cp.PAUSE_MODE_ABORT,
    "wait": cp.PAUSE_MODE_WAIT,
    "keep": cp.PAUSE_MODE_KEEP,
}


def sampling_params(sampling: Sampling = None, **overrides: Any) -> generation_pb2.SamplingParams:
    """Builds SamplingParams from a message, a mapping of its field names, and overrides."""
    params = generation_pb2.SamplingParams()
    if isinstance(sampling, generation_pb2.SamplingParams):
        params.CopyFrom(sampling)
    elif sampling is not None:
        overrides = {**sampling, **overrides}
    for name, value in overrides.items():
        if value is None:
            continue
        if name in ("stop_token_ids", "stop_strings"):
            getattr(params, name)[:] = list(value)
        else:
            setattr(params, name, value)
    return params


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def chat_messages(messages: Sequence[Message]) -> list[data_plane_pb2.ChatMessage]:
    return [
        m if isinstance(m, data_plane_pb2.ChatMessage) else data_plane_pb2.ChatMessage(**m)
        for m in messages
    ]


class InferenceClient:
    """Asyncio client of a skyrl-grpc fleet. See the module docstring."""

    def __init__(self, router: str, servers: Sequence[str] = (), **settings: Any) -> None:
        self._setup(ClientConfig(router=router, servers=tuple(servers), **settings))

    def _setup(self, config: ClientConfig) -> None:
        self.config = config
        # Channels, the routing view and background calls, per event loop (never pickled).
        self._transport = Transport(config, self._finish_at)
        # Rank 0 of the collective weight-transfer group (process-local, never pickled).
        self._sender: CollectiveSender | None = None

    @classmethod
    def from_config(cls, config: ClientConfig) -> InferenceClient:
        client = cls.__new__(cls)
        client._setup(config)
        return client

    # Pickle the config only: channels belong to one process and event loop.
    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["config"])

    def channel(self, address: str) -> grpc.aio.Channel:
        return self._transport.channel(address)

    @property
    def transport(self) -> Transport:
        """This client's per-event-loop resources (channels; other per-loop objects through
        ``transport.loop_local``), closed with their loop."""
        return self._transport

    async def close(self) -> None:
        """Closes what this event loop opened (channels, the routing feed). Also done when
        the loop ends under ``asyncio.run``."""
        await self._transport.close()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _metadata(self, session_id: str | None) -> tuple[tuple[str, str], ...]:
        metadata = self.config.metadata()
        return (*metadata, (SESSION_ID, session_id)) if session_id else metadata

    # -- direct routing -----------------------------------------------------------------------

    def _direct_routes(self) -> DirectRoutes:
        return self._transport.routes()

    async def _target(self, session_id: str | None, tried: set[str]) -> str | None:
        """The server a generation goes to directly, or None to go through the router."""
        if not self.config.direct:
            return None
        routes = self._direct_routes()
        if not await routes.ready():
            return None
        return routes.pick(session_id, tried)

    def _finish_at(self, address: str, session_id: str) -> None:
        """Tells ``address`` a session moved away from it (best effort)."""

        async def finish() -> None:
            request = data_plane_pb2.FinishSessionRequest(session_id=session_id)
            stub = data_plane_pb2_grpc.DataPlaneStub(self.channel(address))
            try:
                await stub.FinishSession(request, timeout=5, metadata=self.config.metadata())
            except grpc.aio.AioRpcError as error:
                log.debug("FinishSession at %s: %s", address, error.code().name)

        self._transport.spawn(finish())

    @property
    def _data(self) -> data_plane_pb2_grpc.DataPlaneAsyncStub:
        return data_plane_pb2_grpc.DataPlaneStub(self.channel(self.config.router))

    async def _unary(
        self,
        address: str,
        call: Callable[..., Awaitable[T]],
        request: Any,
        timeout: float | None,
        session_id: str | None = None,
    ) -> T:
        try:
            return await call(request, timeout=timeout, metadata=self._metadata(session_id))
        except grpc.aio.AioRpcError as error:
            raise ServerError.from_rpc_error(address, error) from error

    # -- data plane ---------------------------------------------------------------------------

    async def stream(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        n: int = 1,
        include_text: bool = False,
        request_id: str = "",
        stream_interval: int = 0,
        lora: str = "",
    ) -> AsyncGenerator[data_plane_pb2.GenerateStreamResponse, None]:
        """The raw stream of one generation (no retry on abort: chunks as the server sends).

        ``stream_interval``: tokens per message after the first (0: one per engine step); larger
        values trade per-token latency for throughput.
        """
        request = data_plane_pb2.GenerateStreamRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params(sampling),
            n=n,
            include_text=include_text,
            stream_interval=stream_interval,
            lora=lora,
        )
        target = await self._target(session_id, set())
        address = target or self.config.router
        stub = data_plane_pb2_grpc.DataPlaneStub(self.channel(address))
        call = stub.GenerateStream(
            request, timeout=self.config.data_timeout, metadata=self._metadata(session_id)
        )
        if target is not None:
            self._direct_routes().begin(target)
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as error:
            if target is not None and error.code() == grpc.StatusCode.UNAVAILABLE:
                self._direct_routes().mark_unavailable(target)
            raise ServerError.from_rpc_error(address, error) from error
        finally:
            call.cancel()
            if target is not None:
                self._direct_routes().end(target)

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        include_text: bool = False,
        lora: str = "",
    ) -> GenerationResult:
        """One sample, resubmitted after aborts (pause for a weight update) until finished.
        ``lora``: the adapter to generate with (``load_lora``); empty: the base model.

        One rule for aborts: a sample still aborted when ``max_abort_retries`` resubmissions
        are used up (0: none) is returned as it is, ``finish_reason`` ABORTED, with the tokens
        generated so far and ``abort_retries``; it is never raised, so one sample cannot
        fail a batch."""
        params = sampling_params(sampling)
        continuation = Continuation(
            list(prompt_token_ids),
            params,
            include_text,
            self.config.max_abort_retries,
            self.config.stream_interval,
            lora,
        )
        tried: set[str] = set()
        while True:
            # Direct to the server the router's policy picks, or through the router.
            target = await self._target(session_id, tried)
            address = target or self.config.router
            stub = data_plane_pb2_grpc.DataPlaneStub(self.channel(address))
            call = stub.GenerateStream(
                continuation.request(),
                timeout=self.config.data_timeout,
                metadata=self._metadata(session_id),
            )
            if target is not None:
                self._direct_routes().begin(target)
            try:
                async for chunk in call:
                    continuation.add(chunk)
            except grpc.aio.AioRpcError as error:
                if (
                    target is None
                    or error.code() != grpc.StatusCode.UNAVAILABLE
                    or len(tried) >= self.config.max_direct_failovers
                ):
                    raise ServerError.from_rpc_error(address, error) from error
                # The server is gone: go on elsewhere with the prompt plus the tokens so far
                # (before the first token, that is a plain retry).
                self._direct_routes().mark_unavailable(target)
                tried.add(target)
                log.warning("server %s failed (%s): moving the generation", target, error.code())
                continue
            finally:
                call.cancel()
                if target is not None:
                    self._direct_routes().end(target)
            if not continuation.should_resubmit():
                break
        sample = continuation.sample()
        result = GenerationResult.from_sample(
            list(prompt_token_ids), sample, params.HasField("logprobs"), continuation.retries
        )
        result.cached_prompt_tokens = continuation.cached_prompt_tokens
        if include_text and continuation.retries:
            # Text deltas split at a retry boundary may cut a multi-byte character: decode the
            # whole id sequence instead.
            result.text = await self.detokenize(result.token_ids)
        return result

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling = None,
        *,
        session_ids: Sequence[str | None] | None = None,
        include_text: bool = False,
        lora: str = "",
    ) -> list[GenerationResult]:
        """Generates for every prompt as concurrent streams; results in input order. If one
        generation fails, the others are cancelled (their requests aborted on the servers)
        before its error is raised."""
        if session_ids is not None and len(session_ids) != len(prompts):
            raise ValueError(f"{len(session_ids)} session ids for {len(prompts)} prompts")
        sessions = session_ids or [None] * len(prompts)
        params = sampling_params(sampling)
        return await all_or_cancel(
            self.generate(p, params, session_id=s, include_text=include_text, lora=lora)
            for p, s in zip(prompts, sessions, strict=True)
        )

    async def sample(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        include_text: bool = False,
    ) -> list[GenerationResult]:
        """``n`` independent samples of one prompt. Without a session they spread over servers
        by load; with one, they all go to the session's server (sharing its prefix cache)."""
        return await self.generate_batch(
            [prompt_token_ids] * n,
            sampling,
            session_ids=[session_id] * n,
            include_text=include_text,
        )

    async def chat(
        self,
        messages: Sequence[Message],
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        lora: str = "",
    ) -> GenerationResult:
        """Chat completion: the model's chat template, then ``generate`` (so aborts retry)."""
        prompt = await self.tokenize(messages=messages, session_id=session_id)
        return await self.generate(
            prompt, sampling, session_id=session_id, include_text=True, lora=lora
        )

    async def complete(
        self,
        prompt: str,
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        lora: str = "",
    ) -> GenerationResult:
        """Text completion: tokenize, then ``generate`` (so aborts retry)."""
        tokens = await self.tokenize(prompt, session_id=session_id)
        return await self.generate(
            tokens, sampling, session_id=session_id, include_text=True, lora=lora
        )

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        add_special_tokens: bool = True,
        session_id: str | None = None,
    ) -> list[int]:
        """Token ids of ``text``, or of ``messages`` through the chat template."""
        if (text is None) == (messages is None):
            raise ValueError("pass exactly one of text and messages")
        if messages is not None:
            request = data_plane_pb2.TokenizeRequest(
                conversation=data_plane_pb2.ChatConversation(messages=chat_messages(messages))
            )
        else:
            request = data_plane_pb2.TokenizeRequest(
                text=text, add_special_tokens=add_special_tokens
            )
        response = await self._unary(
            self.config.router, self._data.Tokenize, request, self.config.data_timeout, session_id
        )
        return list(response.token_ids)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        request = data_plane_pb2.DetokenizeRequest(
            token_ids=list(token_ids), skip_special_tokens=skip_special_tokens
        )
        response = await self._unary(
            self.config.router, self._data.Detokenize, request, self.config.data_timeout
        )
        return str(response.text)

    async def model_info(self) -> data_plane_pb2.GetModelInfoResponse:
        request = data_plane_pb2.GetModelInfoRequest()
        return await self._unary(
            self.config.router, self._data.GetModelInfo, request, self.config.data_timeout
        )

    async def finish_session(self, session_id: str) -> bool:
        """End a session: its server frees the session's place (and the router stops counting
        it), so new sessions can use it. True if a server held the session. Sessions that are
        never finished are released after the servers' ``--session-idle-seconds``."""
        request = data_plane_pb2.FinishSessionRequest(session_id=session_id)
        response = await self._unary(
            self.config.router, self._data.FinishSession, request, self.config.data_timeout
        )
        return bool(response.found)

    # -- control plane (fan-out) --------------------------------------------------------------

    def _control(self, address: str) -> control_plane_pb2_grpc.ControlPlaneAsyncStub:
        return control_plane_pb2_grpc.ControlPlaneStub(self.channel(address))

    async def _fan_out(self, operation: str, request: Any) -> dict[str, Any]:
        async def call(address: str) -> Any:
            method = getattr(self._control(address), operation)
            return await self._unary(address, method, request, self.config.control_timeout)

        return await fan_out(operation, self.config.servers, call)

    # -- LoRA adapters ------------------------------------------------------------------------

    async def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        config: Mapping[str, Any] | None = None,
        version: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> dict[str, lora_pb2.LoraAdapter]:
        """Loads adapter ``name`` on every server at once: in-band (``tensors``, PEFT names,
        e.g. a PEFT model's ``get_peft_model_state_dict``, and ``config``, its
        adapter_config.json as a dict; no shared filesystem) or from ``path``, a directory on
        each server. Loading a name again replaces it with a new version (``version``; 0: the
        next). Raises FanOutError naming the servers that refused it; they keep what they
        served."""
        spec = cp.LoraAdapterSpec(name=name, version=version)
        if path is not None:
            if tensors is not None or config is not None:
                raise ValueError("pass path, or tensors and config, not both")
            spec.path = path
            messages = [cp.LoadLoraAdapterRequest(spec=spec)]
        else:
            if tensors is None or config is None:
                raise ValueError("an in-band adapter needs tensors and config (or pass path)")
            spec.config_json = json.dumps(dict(config))
            pairs = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
            messages = [cp.LoadLoraAdapterRequest(spec=spec)]
            messages += lora_push_messages(pairs, chunk_bytes)

        async def load(address: str) -> lora_pb2.LoraAdapter:
            call: Any = self._control(address).LoadLoraAdapter
            response = await self._unary(address, call, iter(messages), self.config.control_timeout)
            adapter: lora_pb2.LoraAdapter = response.adapter
            return adapter

        return await fan_out("LoadLoraAdapter", self.config.servers, load)

    async def unload_lora(self, name: str) -> dict[str, int]:
        """Unloads adapter ``name`` everywhere; returns each server's last version of it."""
        results = await self._fan_out("UnloadLoraAdapter", cp.UnloadLoraAdapterRequest(name=name))
        return {a: int(r.version) for a, r in results.items()}

    async def list_loras(self) -> dict[str, list[lora_pb2.LoraAdapter]]:
        """Each server's loaded adapters, with versions and checksums."""
        results = await self._fan_out("ListLoraAdapters", cp.ListLoraAdaptersRequest())
        return {a: list(r.adapters) for a, r in results.items()}

    async def pause(self, mode: str = "abort", clear_cache: bool = False) -> dict[str, None]:
        """Pauses every server (mode "abort", "wait" or "keep"); returns once all are paused."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode {mode!r}: use one of {', '.join(PAUSE_MODES)}")
        await self._fan_out(
            "Pause", cp.PauseRequest(mode=PAUSE_MODES[mode], clear_cache=clear_cache)
        )
        return dict.fromkeys(self.config.servers)

    async def resume(self) -> dict[str, None]:
        await self._fan_out("Resume", cp.ResumeRequest())
        return dict.fromkeys(self.config.servers)

    async def is_paused(self) -> dict[str, bool]:
        results = await self._fan_out("IsPaused", cp.IsPausedRequest())
        return {a: bool(r.paused) for a, r in results.items()}

    async def all_paused(self) -> bool:
        return all((await self.is_paused()).values())

    async def sleep(self, level: int = 1) -> dict[str, None]:
        await self._fan_out("Sleep", cp.SleepRequest(level=level))
        return dict.fromkeys(self.config.servers)

    async def wake_up(self, tags: Sequence[str] = ()) -> dict[str, None]:
        await self._fan_out("WakeUp", cp.WakeUpRequest(tags=list(tags)))
        return dict.fromkeys(self.config.servers)

    async def is_sleeping(self) -> dict[str, bool]:
        results = await self._fan_out("IsSleeping", cp.IsSleepingRequest())
        return {a: bool(r.sleeping) for a, r in results.items()}

    async def reset_prefix_cache(self) -> dict[str, None]:
        await self._fan_out("ResetPrefixCache", cp.ResetPrefixCacheRequest())
        return dict.fromkeys(self.config.servers)

    async def server_info(self) -> dict[str, cp.GetServerInfoResponse]:
        return await self._fan_out("GetServerInfo", cp.GetServerInfoRequest())

    async def load(self) -> dict[str, cp.GetLoadResponse]:
        return await self._fan_out("GetLoad", cp.GetLoadRequest())

    async def world_size(self) -> int:
        """Devices across the fleet: the sum of every server's world size."""
        return sum(info.world_size for info in (await self.server_info()).values())

    # -- weight transfer ----------------------------------------------------------------------

    async def init_weight_transfer(
        self,
        backend: str = "gloo",
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "skyrl",
        timeout_seconds: float = 300.0,
    ) -> dict[str, int]:
        """Forms the collective group: this process is rank 0, each server joins with its own
        rank offset (computed from the servers' world sizes). Returns each server's offset."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: use 'gloo' or 'nccl' (in-band needs no group)")
        infos = await self.server_info()
        servers = list(self.config.servers)
        offsets, world_size = rank_offsets([infos[a].world_size for a in servers])
        port = master_port or free_port(master_address)
        sender = CollectiveSender(
            backend, master_address, port, world_size, group_name, timeout_seconds
        )
        by_server = dict(zip(servers, offsets, strict=True))
        proto_backend = (
            cp.WEIGHT_TRANSFER_BACKEND_GLOO
            if backend == "gloo"
            else cp.WEIGHT_TRANSFER_BACKEND_NCCL
        )

        async def init(address: str) -> Any:
            request = cp.InitWeightTransferRequest(
                backend=proto_backend,
                master_address=master_address,
                master_port=port,
                rank_offset=by_server[address],
                world_size=world_size,
                group_name=group_name,
                timeout_seconds=int(timeout_seconds),
            )
            return await self._unary(
                address, self._control(address).InitWeightTransfer, request, timeout_seconds
            )

        async def init_or_give_up(address: str) -> Any:
            try:
                return await init(address)
            except BaseException:
                sender.cancel_join()  # the others stop waiting for this server at once
                raise

        # Both sides block until every rank joined: run the trainer's join beside the servers'.
        join = asyncio.ensure_future(asyncio.to_thread(sender.join))
        try:
            await fan_out("InitWeightTransfer", servers, init_or_give_up)
        except BaseException:
            sender.cancel_join()
            # The join thread ends promptly; its error (the rendezvous given up) says nothing
            # the fan-out's does not. Every server's call has ended, so none still reads the
            # store: close it, freeing the master port.
            await asyncio.gather(join, return_exceptions=True)
            sender.release()
            raise
        await join
        self._sender = sender
        return by_server

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        weight_version: int | None = None,
        *,
        transport: str = "collective",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        checksums: bool = True,
        timeout: float = 600.0,
        lease_seconds: int = 0,
    ) -> dict[str, cp.FinishWeightUpdateResponse]:
        """Pushes new weights to every server and commits ``weight_version`` on all of them,
        or on none: a fleet-wide transaction (``trainer_client.weight_transaction``).

        ``weight_version``: what the new weights serve as; must be newer than what every server
        serves, and is checked before any weight is sent. None: one more than the newest
        version any server serves. ``transport``: "collective" (the group from
        ``init_weight_transfer``) or "grpc" (in-band streams, no group needed). ``timeout``:
        seconds for the transfer. ``lease_seconds``: how long the servers keep the update open
        if this process dies mid-way (0: their default).

        On any failure (a server unreachable, a rejected chunk or version, a timeout) the update
        is cancelled on every server and rolled back where it was already committed, then
        ``WeightUpdateError`` names each server, what happened there and the version it serves
        now. Returns each server's answer to the commit (the version, parameters replaced).
        """
        tensors = list(named_tensors)
        servers = list(self.config.servers)
        if transport not in ("collective", "grpc"):
            raise ValueError(f"transport {transport!r}: use 'collective' or 'grpc'")
        sender = self._sender
        if transport == "collective" and sender is None:
            raise ValueError(
                "no collective group: call init_weight_transfer() or use transport='grpc'"
            )
        if not servers:
            raise ValueError("update_weights: the client has no server addresses")
        if weight_version is not None and weight_version <= 0:
            # 0 means "unset" on the wire and every server starts at 0: refused before a byte
            # moves, instead of after the whole model was pushed.
            raise ValueError(
                f"weight_version={weight_version}: versions start at 1 and must increase "
                "(None: one more than the newest version any server serves)"
            )
        calls = _TransactionCalls(self, lease_seconds)
        if weight_version is None:
            # From the servers that answer: one that does not fails the update at its start,
            # where the error reports every server.
            versions = await asyncio.gather(
                *(calls.serving_version(a) for a in servers), return_exceptions=True
            )
            weight_version = 1 + max((v for v in versions if isinstance(v, int)), default=0)

        async def transfer(addresses: Sequence[str]) -> dict[str, BaseException]:
            if sender is not None and transport == "collective":
                return await self._broadcast(
                    sender, addresses, tensors, bucket_bytes, checksums, timeout
                )
            return await self._push(addresses, tensors, chunk_bytes, checksums, timeout)

        return await run_weight_transaction(servers, weight_version, calls, transfer)

    async def _broadcast(
        self,
        sender: CollectiveSender,
        addresses: Sequence[str],
        tensors: list[tuple[str, Any]],
        bucket_bytes: int,
        checksums: bool,
        timeout: float,
    ) -> dict[str, BaseException]:
        buckets = plan_buckets(tensors, bucket_bytes, checksums)
        request = cp.UpdateWeightsRequest(buckets=[b.layout for b in buckets])

        async def update(address: str) -> object:
            return await self._unary(
                address, self._control(address).UpdateWeights, request, timeout
            )

        # Every server receives while rank 0 broadcasts; a server that rejects the layout still
        # receives (and drops) the bytes, so the broadcast completes.
        broadcast = asyncio.ensure_future(asyncio.to_thread(sender.broadcast, buckets))
        failures = await failures_of(addresses, update)
        try:
            await broadcast
        except Exception as error:
            failures.update({a: error for a in addresses if a not in failures})
        return failures

    async def _push(
        self,
        addresses: Sequence[str],
        tensors: list[tuple[str, Any]],
        chunk_bytes: int,
        checksums: bool,
        timeout: float,
    ) -> dict[str, BaseException]:
        messages = push_messages(tensors, chunk_bytes, checksums)  # serialized once for all

        async def push(address: str) -> object:
            method: grpc.aio.StreamUnaryMultiCallable[bytes, cp.PushWeightsResponse]
            method = self.channel(address).stream_unary(
                PUSH_WEIGHTS,
                request_serializer=None,
                response_deserializer=cp.PushWeightsResponse.FromString,
            )
            return await self._unary(address, method, iter(messages), timeout)

        return await failures_of(addresses, push)

    async def cancel_weight_update(self) -> dict[str, int]:
        """Cancels the weight update open on any server (e.g. one a crashed trainer left);
        returns the parameters each server dropped (0 where none was open)."""

        async def cancel(address: str) -> int:
            try:
                response = await self._unary(
                    address,
                    self._control(address).CancelWeightUpdate,
                    cp.CancelWeightUpdateRequest(),
                    self.config.control_timeout,
                )
            except ServerError as error:
                if error.code == grpc.StatusCode.FAILED_PRECONDITION:
                    return 0  # nothing open there
                raise
            return int(response.parameters_discarded)

        return await fan_out("CancelWeightUpdate", self.config.servers, cancel)

    async def rollback_weights(self, weight_version: int) -> dict[str, int]:
        """On every server, undoes the commit of ``weight_version`` (possible until the next
        update starts); returns the version each server serves again."""
        results = await self._fan_out(
            "RollbackWeightUpdate", cp.RollbackWeightUpdateRequest(weight_version=weight_version)
        )
        return {a: int(r.weight_version) for a, r in results.items()}

    async def weight_checksums(self, names: Sequence[str] = ()) -> dict[str, dict[str, bytes]]:
        """SHA-256 of every server's serving weights, per parameter (checkpoint names)."""
        results = await self._fan_out(
            "GetWeightChecksums", cp.GetWeightChecksumsRequest(names=list(names))
        )
        return {a: {c.name: c.sha256 for c in r.checksums} for a, r in results.items()}

    async def weight_versions(self) -> WeightVersions:
        """The version each server serves; ``.consistent`` / ``.behind()`` show a mismatch
        (e.g. a restarted server back on its initial weights)."""
        infos = await self.server_info()
        return WeightVersions({a: int(info.weight_version) for a, info in infos.items()})


def owner_name() -> str:
    """How this process names itself to the servers (in weight-update leases)."""
    return f"trainer@{socket.gethostname()}:{os.getpid()}"


class _TransactionCalls:
    """The per-server calls of a fleet weight update, over the client's channels."""

    def __init__(self, client: InferenceClient, lease_seconds: int) -> None:
        self._client = client
        self._lease_seconds = lease_seconds
        self._owner = owner_name()

    async def _call(self, address: str, method: str, request: Any) -> Any:
        client = self._client
        rpc = getattr(client._control(address), method)
        return await client._unary(address, rpc, request, client.config.control_timeout)

    async def start(self, address: str, version: int) -> int:
        request = cp.StartWeightUpdateRequest(
            weight_version=version, owner=self._owner, lease_seconds=self._lease_seconds
        )
        response = await self._call(address, "StartWeightUpdate", request)
        return int(response.serving_weight_version)

    async def finish(self, address: str, version: int) -> cp.FinishWeightUpdateResponse:
        request = cp.FinishWeightUpdateRequest(weight_version=version)
        response: cp.FinishWeightUpdateResponse = await self._call(
            address, "FinishWeightUpdate", request
        )
        return response

    async def cancel(self, address: str) -> None:
        await self._call(address, "CancelWeightUpdate", cp.CancelWeightUpdateRequest())

    async def rollback(self, address: str, version: int) -> int:
        request = cp.RollbackWeightUpdateRequest(weight_version=version)
        response = await self._call(address, "RollbackWeightUpdate", request)
        return int(response.weight_version)

    async def serving_version(self, address: str) -> int:
        info = await self._call(address, "GetServerInfo", cp.GetServerInfoRequest())
        return int(info.weight_version)
