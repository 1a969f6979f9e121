"""``BlockingInferenceClient``: the same methods as ``InferenceClient``, without ``await``.

It runs the asyncio client on a private event loop in a daemon thread, so there is one
implementation of every behaviour (retry on abort, fan-out) and only the calling convention
differs. Each method below is a typed one-line forward, so IDEs, ``help()`` and type checkers
see the real signatures; ``tests/client/test_blocking_client.py`` checks that the two surfaces match
exactly. Pickles like the async client (its config only).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, Unpack

from skyrl_grpc.v1 import data_plane_pb2
from trainer_client.client import InferenceClient
from trainer_client.config import ClientConfig, ClientSettings
from trainer_client.fleet_info import (
    LoraAdapter,
    ModelInfo,
    PauseMode,
    ServerInfo,
    ServerLoad,
    WeightUpdateResult,
)
from trainer_client.results import GenerationResult, WeightVersions
from trainer_client.sampling import Message, Sampling
from trainer_client.tool_use import Tool, ToolChoice
from trainer_client.weights.weight_sending import DEFAULT_BUCKET_BYTES, DEFAULT_CHUNK_BYTES
from trainer_client.weights.weight_updates import WeightTransport

T = TypeVar("T")


class BlockingInferenceClient:
    """Blocking twin of ``InferenceClient``; see the module docstring and the async methods'
    docstrings for what each call does."""

    def __init__(
        self, router: str, servers: Sequence[str] = (), **settings: Unpack[ClientSettings]
    ) -> None:
        self._client = InferenceClient(router, servers, **settings)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: ClientConfig) -> BlockingInferenceClient:
        client = cls.__new__(cls)
        client.__setstate__({"config": config})
        return client

    @property
    def config(self) -> ClientConfig:
        return self._client.config

    @property
    def async_client(self) -> InferenceClient:
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._client = InferenceClient.from_config(state["config"])
        self._loop = None
        self._thread = None
        self._lock = threading.Lock()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="skyrl-client", daemon=True
                )
                self._thread.start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

    def close(self) -> None:
        """Closes the client's channels, cancels what still runs on its loop, and ends the
        loop and its thread. The client may be used again afterwards (a new loop starts)."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(_shut_down(self._client), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    def __enter__(self) -> BlockingInferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- data plane ---------------------------------------------------------------------------

    def stream(
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
        timeout: float | None = None,
    ) -> Iterator[data_plane_pb2.GenerateStreamResponse]:
        chunks = self._client.stream(
            prompt_token_ids,
            sampling,
            session_id=session_id,
            n=n,
            include_text=include_text,
            request_id=request_id,
            stream_interval=stream_interval,
            lora=lora,
            timeout=timeout,
        )
        try:
            while True:
                try:
                    yield self._run(chunks.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(chunks.aclose())

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        include_text: bool = False,
        lora: str = "",
        timeout: float | None = None,
    ) -> GenerationResult:
        return self._run(
            self._client.generate(
                prompt_token_ids,
                sampling,
                session_id=session_id,
                include_text=include_text,
                lora=lora,
                timeout=timeout,
            )
        )

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling = None,
        *,
        session_ids: Sequence[str | None] | None = None,
        include_text: bool = False,
        lora: str = "",
        timeout: float | None = None,
    ) -> list[GenerationResult]:
        return self._run(
            self._client.generate_batch(
                prompts,
                sampling,
                session_ids=session_ids,
                include_text=include_text,
                lora=lora,
                timeout=timeout,
            )
        )

    def sample(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling = None,
        *,
        n: int,
        session_id: str | None = None,
        include_text: bool = False,
        lora: str = "",
        timeout: float | None = None,
    ) -> list[GenerationResult]:
        return self._run(
            self._client.sample(
                prompt_token_ids,
                sampling,
                n=n,
                session_id=session_id,
                include_text=include_text,
                lora=lora,
                timeout=timeout,
            )
        )

    def chat(
        self,
        messages: Sequence[Message],
        sampling: Sampling = None,
        *,
        tools: Sequence[Tool | Mapping[str, Any]] = (),
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool | None = None,
        session_id: str | None = None,
        lora: str = "",
        timeout: float | None = None,
    ) -> GenerationResult:
        return self._run(
            self._client.chat(
                messages,
                sampling,
                tools=tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                session_id=session_id,
                lora=lora,
                timeout=timeout,
            )
        )

    def complete(
        self,
        prompt: str,
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        lora: str = "",
        timeout: float | None = None,
    ) -> GenerationResult:
        return self._run(
            self._client.complete(
                prompt, sampling, session_id=session_id, lora=lora, timeout=timeout
            )
        )

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        add_special_tokens: bool = True,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        return self._run(
            self._client.tokenize(
                text,
                messages=messages,
                add_special_tokens=add_special_tokens,
                session_id=session_id,
                timeout=timeout,
            )
        )

    def detokenize(
        self,
        token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        timeout: float | None = None,
    ) -> str:
        return self._run(self._client.detokenize(token_ids, skip_special_tokens, timeout=timeout))

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return self._run(self._client.model_info(timeout=timeout))

    def finish_session(self, session_id: str, *, timeout: float | None = None) -> bool:
        return self._run(self._client.finish_session(session_id, timeout=timeout))

    # -- LoRA adapters ------------------------------------------------------------------------

    def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        config: Mapping[str, Any] | None = None,
        version: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> dict[str, LoraAdapter]:
        return self._run(
            self._client.load_lora(
                name,
                path=path,
                tensors=tensors,
                config=config,
                version=version,
                chunk_bytes=chunk_bytes,
                timeout=timeout,
            )
        )

    def unload_lora(self, name: str, *, timeout: float | None = None) -> dict[str, int]:
        return self._run(self._client.unload_lora(name, timeout=timeout))

    def list_loras(self, *, timeout: float | None = None) -> dict[str, list[LoraAdapter]]:
        return self._run(self._client.list_loras(timeout=timeout))

    # -- control plane ------------------------------------------------------------------------

    def pause(
        self,
        mode: PauseMode | str = PauseMode.ABORT,
        clear_cache: bool = False,
        *,
        timeout: float | None = None,
        wait_for_starting: float = 120.0,
    ) -> list[str]:
        return self._run(
            self._client.pause(
                mode, clear_cache, timeout=timeout, wait_for_starting=wait_for_starting
            )
        )

    def resume(
        self, *, timeout: float | None = None, wait_for_starting: float = 120.0
    ) -> list[str]:
        return self._run(self._client.resume(timeout=timeout, wait_for_starting=wait_for_starting))

    def is_paused(self, *, timeout: float | None = None) -> dict[str, bool]:
        return self._run(self._client.is_paused(timeout=timeout))

    def all_paused(self, *, timeout: float | None = None) -> bool:
        return self._run(self._client.all_paused(timeout=timeout))

    def sleep(self, level: int = 1, *, timeout: float | None = None) -> list[str]:
        return self._run(self._client.sleep(level, timeout=timeout))

    def wake_up(self, tags: Sequence[str] = (), *, timeout: float | None = None) -> list[str]:
        return self._run(self._client.wake_up(tags, timeout=timeout))

    def is_sleeping(self, *, timeout: float | None = None) -> dict[str, bool]:
        return self._run(self._client.is_sleeping(timeout=timeout))

    def reset_prefix_cache(self, *, timeout: float | None = None) -> list[str]:
        return self._run(self._client.reset_prefix_cache(timeout=timeout))

    def server_info(self, *, timeout: float | None = None) -> dict[str, ServerInfo]:
        return self._run(self._client.server_info(timeout=timeout))

    def server_loads(self, *, timeout: float | None = None) -> dict[str, ServerLoad]:
        return self._run(self._client.server_loads(timeout=timeout))

    def world_size(self, *, timeout: float | None = None) -> int:
        return self._run(self._client.world_size(timeout=timeout))

    # -- weight transfer ----------------------------------------------------------------------

    @property
    def has_weight_group(self) -> bool:
        return self._client.has_weight_group

    def init_weight_transfer(
        self,
        backend: str = "gloo",
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "skyrl",
        timeout_seconds: float = 300.0,
    ) -> dict[str, int]:
        return self._run(
            self._client.init_weight_transfer(
                backend,
                master_address=master_address,
                master_port=master_port,
                group_name=group_name,
                timeout_seconds=timeout_seconds,
            )
        )

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        weight_version: int | None = None,
        *,
        transport: WeightTransport | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        chunk_bytes: int | None = None,
        checksums: bool = False,
        timeout: float = 600.0,
        lease_seconds: int = 0,
        delta: bool = True,
        compress_patches: bool = False,
        wait_for_starting: float = 120.0,
        release_memory: bool = False,
    ) -> WeightUpdateResult:
        return self._run(
            self._client.update_weights(
                named_tensors,
                weight_version,
                transport=transport,
                bucket_bytes=bucket_bytes,
                chunk_bytes=chunk_bytes,
                checksums=checksums,
                timeout=timeout,
                lease_seconds=lease_seconds,
                delta=delta,
                compress_patches=compress_patches,
                wait_for_starting=wait_for_starting,
                release_memory=release_memory,
            )
        )

    def reserve_delta_base(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self._run(self._client.reserve_delta_base(named_tensors))

    def cancel_weight_update(self, *, timeout: float | None = None) -> dict[str, int]:
        return self._run(self._client.cancel_weight_update(timeout=timeout))

    def rollback_weights(
        self, weight_version: int, *, timeout: float | None = None
    ) -> dict[str, int]:
        return self._run(self._client.rollback_weights(weight_version, timeout=timeout))

    def weight_checksums(
        self, names: Sequence[str] = (), *, timeout: float | None = None
    ) -> dict[str, dict[str, bytes]]:
        return self._run(self._client.weight_checksums(names, timeout=timeout))

    def weight_versions(self, *, timeout: float | None = None) -> WeightVersions:
        return self._run(self._client.weight_versions(timeout=timeout))


async def _shut_down(client: InferenceClient) -> None:
    """The client's resources on this loop, then every task still pending on it."""
    await client.close()
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
