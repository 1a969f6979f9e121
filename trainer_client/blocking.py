"""``BlockingInferenceClient``: the same methods as ``InferenceClient``, without ``await``.

It runs the asyncio client on a private event loop in a daemon thread, so there is one
implementation of every behaviour (retry on abort, fan-out) and only the calling convention
differs. Pickles like the async client (its config only).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from .client import InferenceClient
from .config import ClientConfig

T = TypeVar("T")

# Every coroutine method of InferenceClient that the blocking twin exposes under the same name.
BLOCKING_METHODS = (
    "generate",
    "generate_batch",
    "sample",
    "chat",
    "complete",
    "tokenize",
    "detokenize",
    "model_info",
    "pause",
    "resume",
    "is_paused",
    "all_paused",
    "sleep",
    "wake_up",
    "is_sleeping",
    "reset_prefix_cache",
    "server_info",
    "load",
    "world_size",
    "init_weight_transfer",
    "update_weights",
    "weight_checksums",
    "weight_versions",
)


class BlockingInferenceClient:
    """Blocking twin of ``InferenceClient``; see the module docstring."""

    def __init__(
        self, router: str, servers: tuple[str, ...] | list[str] = (), **settings: Any
    ) -> None:
        self._client = InferenceClient(router, servers, **settings)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: ClientConfig) -> BlockingInferenceClient:
        client = cls.__new__(cls)
        client._client = InferenceClient.from_config(config)
        client._loop = None
        client._lock = threading.Lock()
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
        self._lock = threading.Lock()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=self._loop.run_forever, name="skyrl-client", daemon=True
                ).start()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """Blocking iterator over ``InferenceClient.stream``."""
        chunks = self._client.stream(*args, **kwargs)
        try:
            while True:
                try:
                    yield self._run(chunks.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(chunks.aclose())

    def close(self) -> None:
        if self._loop is not None:
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    def __enter__(self) -> BlockingInferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _blocking(name: str) -> Callable[..., Any]:
    method = getattr(InferenceClient, name)

    @functools.wraps(method)
    def call(self: BlockingInferenceClient, *args: Any, **kwargs: Any) -> Any:
        return self._run(getattr(self._client, name)(*args, **kwargs))

    return call


for _name in BLOCKING_METHODS:
    setattr(BlockingInferenceClient, _name, _blocking(_name))
