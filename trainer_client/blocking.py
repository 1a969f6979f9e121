"""``BlockingInferenceClient``: the same methods as ``InferenceClient``, without ``await``.

It runs the asyncio client on a private event loop in a daemon thread, so there is one
implementation of every behaviour (retry on abort, fan-out) and only the calling convention
differs. Every method is derived from the async client's in one line (``blocking``: a call
run to its end on that loop; ``blocking_stream``: an async stream read as an iterator), with
the async method's name, parameters and docstring, so IDEs, ``help()`` and type checkers see
the real signatures; ``tests/client/test_blocking_client.py`` checks that the two surfaces
match exactly. Pickles like the async client (its config only).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar, Unpack, cast

from trainer_client.client import InferenceClient
from trainer_client.config import ClientConfig, ClientSettings

T = TypeVar("T")
P = ParamSpec("P")


def blocking(
    method: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[BlockingInferenceClient, P], T]:
    """The blocking twin of the async client's ``method``: the same call, run to its end on
    the blocking client's loop."""
    name = method.__name__

    @functools.wraps(method)
    def run(self: BlockingInferenceClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        call: Coroutine[Any, Any, T] = getattr(self._client, name)(*args, **kwargs)
        return self._run(call)

    return run


def blocking_stream(
    method: Callable[Concatenate[Any, P], AsyncGenerator[T, None]],
) -> Callable[Concatenate[BlockingInferenceClient, P], Iterator[T]]:
    """The blocking twin of an async stream of the client: an iterator whose every item is
    read on the blocking client's loop; closing it (or leaving a ``for`` loop) closes the
    stream."""
    name = method.__name__

    @functools.wraps(method)
    def read(self: BlockingInferenceClient, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        chunks = getattr(self._client, name)(*args, **kwargs)
        try:
            while True:
                try:
                    yield self._run(chunks.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(chunks.aclose())

    # What it returns: an iterator of what the stream yields.
    signature = inspect.signature(method)
    item = str(signature.return_annotation)
    for prefix in ("AsyncGenerator[", "AsyncIterator["):
        if item.startswith(prefix):
            item = item.removeprefix(prefix).removesuffix("]").removesuffix(", None")
    read.__signature__ = signature.replace(  # type: ignore[attr-defined]
        return_annotation=f"Iterator[{item}]"
    )
    return cast("Callable[Concatenate[BlockingInferenceClient, P], Iterator[T]]", read)


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

    @property
    def cut_out_servers(self) -> dict[str, str]:
        return self._client.cut_out_servers

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

    # -- every method of the async client, derived (``blocking``, ``blocking_stream``) ----------
    stream = blocking_stream(InferenceClient.stream)
    generate = blocking(InferenceClient.generate)
    generate_batch = blocking(InferenceClient.generate_batch)
    sample = blocking(InferenceClient.sample)
    chat = blocking(InferenceClient.chat)
    complete = blocking(InferenceClient.complete)
    tokenize = blocking(InferenceClient.tokenize)
    detokenize = blocking(InferenceClient.detokenize)
    model_info = blocking(InferenceClient.model_info)
    finish_session = blocking(InferenceClient.finish_session)
    pause = blocking(InferenceClient.pause)
    resume = blocking(InferenceClient.resume)
    is_paused = blocking(InferenceClient.is_paused)
    all_paused = blocking(InferenceClient.all_paused)
    sleep = blocking(InferenceClient.sleep)
    wake_up = blocking(InferenceClient.wake_up)
    is_sleeping = blocking(InferenceClient.is_sleeping)
    reset_prefix_cache = blocking(InferenceClient.reset_prefix_cache)
    server_info = blocking(InferenceClient.server_info)
    server_loads = blocking(InferenceClient.server_loads)
    world_size = blocking(InferenceClient.world_size)
    load_lora = blocking(InferenceClient.load_lora)
    unload_lora = blocking(InferenceClient.unload_lora)
    list_loras = blocking(InferenceClient.list_loras)
    init_weight_transfer = blocking(InferenceClient.init_weight_transfer)
    update_weights = blocking(InferenceClient.update_weights)
    reserve_delta_base = blocking(InferenceClient.reserve_delta_base)
    cancel_weight_update = blocking(InferenceClient.cancel_weight_update)
    rollback_weights = blocking(InferenceClient.rollback_weights)
    weight_checksums = blocking(InferenceClient.weight_checksums)
    weight_versions = blocking(InferenceClient.weight_versions)


async def _shut_down(client: InferenceClient) -> None:
    """The client's resources on this loop, then every task still pending on it."""
    await client.close()
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
