"""``BlockingInferenceClient``: the same methods as ``InferenceClient``, without ``await``.

It runs the asyncio client on a private event loop in a daemon thread, so there is one
implementation of every behaviour (retry on abort, fan-out) and only the calling convention
differs. Each method below is a typed one-line forward, so IDEs, ``help()`` and type checkers
see the real signatures; ``tests/test_blocking_client.py`` checks that the two surfaces match
exactly. Pickles like the async client (its config only).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import data_plane_pb2, lora_pb2

from .client import InferenceClient, Message, Sampling
from .config import ClientConfig
from .results import GenerationResult, WeightVersions
from .weights import DEFAULT_BUCKET_BYTES, DEFAULT_CHUNK_BYTES

T = TypeVar("T")


class BlockingInferenceClient:
    """Blocking twin of ``InferenceClient``; see the module docstring and the async methods'
    docstrings for what each call does."""

    def __init__(
        self, router: str, servers: tuple[str, ...] | list[str] = (), **settings: Any
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
        stream_interval: int = 0,
        lora: str = "",
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
    ) -> GenerationResult:
        return self._run(
            self._client.generate(
                prompt_token_ids,
                sampling,
                session_id=session_id,
                include_text=include_text,
                lora=lora,
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
    ) -> list[GenerationResult]:
        return self._run(
            self._client.generate_batch(
                prompts, sampling, session_ids=session_ids, include_text=include_text, lora=lora
            )
        )

    def sample(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        include_text: bool = False,
    ) -> list[GenerationResult]:
        return self._run(
            self._client.sample(
                prompt_token_ids, n, sampling, session_id=session_id, include_text=include_text
            )
        )

    def chat(
        self,
        messages: Sequence[Message],
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        lora: str = "",
    ) -> GenerationResult:
        return self._run(self._client.chat(messages, sampling, session_id=session_id, lora=lora))

    def complete(
        self,
        prompt: str,
        sampling: Sampling = None,
        *,
        session_id: str | None = None,
        lora: str = "",
    ) -> GenerationResult:
        return self._run(self._client.complete(prompt, sampling, session_id=session_id, lora=lora))

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        add_special_tokens: bool = True,
        session_id: str | None = None,
    ) -> list[int]:
        return self._run(
            self._client.tokenize(
                text,
                messages=messages,
                add_special_tokens=add_special_tokens,
                session_id=session_id,
            )
        )

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._run(self._client.detokenize(token_ids, skip_special_tokens))

    def model_info(self) -> data_plane_pb2.GetModelInfoResponse:
        return self._run(self._client.model_info())

    def finish_session(self, session_id: str) -> bool:
        return self._run(self._client.finish_session(session_id))

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
    ) -> dict[str, lora_pb2.LoraAdapter]:
        return self._run(
            self._client.load_lora(
                name,
                path=path,
                tensors=tensors,
                config=config,
                version=version,
                chunk_bytes=chunk_bytes,
            )
        )

    def unload_lora(self, name: str) -> dict[str, int]:
        return self._run(self._client.unload_lora(name))

    def list_loras(self) -> dict[str, list[lora_pb2.LoraAdapter]]:
        return self._run(self._client.list_loras())

    # -- control plane ------------------------------------------------------------------------

    def pause(self, mode: str = "abort", clear_cache: bool = False) -> dict[str, None]:
        return self._run(self._client.pause(mode, clear_cache))

    def resume(self) -> dict[str, None]:
        return self._run(self._client.resume())

    def is_paused(self) -> dict[str, bool]:
        return self._run(self._client.is_paused())

    def all_paused(self) -> bool:
        return self._run(self._client.all_paused())

    def sleep(self, level: int = 1) -> dict[str, None]:
        return self._run(self._client.sleep(level))

    def wake_up(self, tags: Sequence[str] = ()) -> dict[str, None]:
        return self._run(self._client.wake_up(tags))

    def is_sleeping(self) -> dict[str, bool]:
        return self._run(self._client.is_sleeping())

    def reset_prefix_cache(self) -> dict[str, None]:
        return self._run(self._client.reset_prefix_cache())

    def server_info(self) -> dict[str, cp.GetServerInfoResponse]:
        return self._run(self._client.server_info())

    def load(self) -> dict[str, cp.GetLoadResponse]:
        return self._run(self._client.load())

    def world_size(self) -> int:
        return self._run(self._client.world_size())

    # -- weight transfer ----------------------------------------------------------------------

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
        transport: str = "collective",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        checksums: bool = True,
        timeout: float = 600.0,
        lease_seconds: int = 0,
    ) -> dict[str, cp.FinishWeightUpdateResponse]:
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
            )
        )

    def cancel_weight_update(self) -> dict[str, int]:
        return self._run(self._client.cancel_weight_update())

    def rollback_weights(self, weight_version: int) -> dict[str, int]:
        return self._run(self._client.rollback_weights(weight_version))

    def weight_checksums(self, names: Sequence[str] = ()) -> dict[str, dict[str, bytes]]:
        return self._run(self._client.weight_checksums(names))

    def weight_versions(self) -> WeightVersions:
        return self._run(self._client.weight_versions())


async def _shut_down(client: InferenceClient) -> None:
    """The client's resources on this loop, then every task still pending on it."""
    await client.close()
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
