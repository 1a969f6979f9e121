"""LoRA adapters on one engine server, end to end: an upload is checked and staged, loaded
into the engine, swapped in under its name as a new version, and old versions are removed once
no request runs on them. Requests take the version serving when they start (``begin`` /
``end``), so a replaced adapter never changes under a running request.

``AdapterManager`` owns the registry, the staging directory, versions and the load lock; the
engine gives it plain callables (``EngineAdapterCalls``: add, remove), as the weight manager
takes its workers' calls, so this logic runs and is tested without vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from servers.engine.domain.lora_adapters.checks import ModelShapes
from servers.engine.domain.lora_adapters.registry import AdapterRegistry, LoadedAdapter
from servers.engine.domain.lora_adapters.upload import (
    AdapterCopy,
    AdapterSpec,
    AdapterUpload,
    read_tensors,
)
from skyrl_grpc.errors import FailedPrecondition, InvalidArgument, NotFound

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterLimits:
    """What a server's LoRA serving allows (its flags)."""

    enabled: bool
    max_loras: int = 0  # adapters usable in one batch
    max_lora_rank: int = 0
    max_cpu_loras: int = 0  # adapters kept loaded


@dataclass(frozen=True)
class EngineAdapterCalls:
    """What the manager needs of the engine. ``add(name, engine_id, directory)``: loads the
    staged adapter, True if the engine took it (raises or returns False if not);
    ``remove(engine_id)``: drops a version the engine holds (best effort)."""

    add: Callable[[str, int, Path], Awaitable[bool]]
    remove: Callable[[int], Awaitable[None]]


class AdapterManager:
    """See the module docstring. ``shapes``: the base model's (adapters are checked against
    them); None when LoRA is off, and then every call but ``begin("")`` is refused."""

    def __init__(
        self, limits: AdapterLimits, shapes: ModelShapes | None, calls: EngineAdapterCalls
    ) -> None:
        self.limits = limits
        self._shapes = shapes
        self._calls = calls
        self._registry = (
            AdapterRegistry(limits.max_cpu_loras) if limits.enabled and shapes else None
        )
        self._lock = asyncio.Lock()
        self._removals: set[asyncio.Task[None]] = set()

    def _enabled(self) -> AdapterRegistry:
        if self._registry is None:
            raise FailedPrecondition(
                "this server does not serve LoRA adapters: start it with --enable-lora"
            )
        return self._registry

    @property
    def shapes(self) -> ModelShapes:
        self._enabled()
        assert self._shapes is not None
        return self._shapes

    def staging_dir(self, name: str) -> Path:
        """A fresh directory in the server's staging area (removed with the manager)."""
        return self._enabled().staging_dir(name)

    def upload(self, spec: AdapterSpec) -> AdapterUpload:
        """Checks a LoadLoraAdapter spec; the upload then takes the stream's other messages."""
        self._enabled()
        return AdapterUpload(spec, self.limits.max_lora_rank, self.shapes)

    async def load(self, upload: AdapterUpload) -> tuple[LoadedAdapter, int]:
        """Stages, loads into the engine and swaps in an adapter; returns it and the version
        it replaced (0: none). Nothing changes unless every step succeeds."""
        registry = self._enabled()
        name = upload.spec.name
        async with self._lock:
            version = registry.next_version(name, upload.spec.version)
            staging = registry.staging_dir(name) if upload.in_band else None
            try:
                path, digest = await asyncio.to_thread(upload.stage, staging)
                adapter = LoadedAdapter(
                    name=name,
                    version=version,
                    vllm_id=registry.allocate_id(),
                    path=path,
                    config=upload.config,
                    source="in-band" if upload.in_band else "path",
                    sha256=digest,
                    owned=upload.in_band,
                )
                try:
                    loaded = await self._calls.add(name, adapter.vllm_id, path)
                except Exception as error:
                    raise InvalidArgument(
                        f"the engine could not load adapter {name!r}: {error}"
                    ) from error
                if not loaded:
                    raise InvalidArgument(f"the engine refused adapter {name!r}")
            except BaseException:
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
                raise
            previous, unused = registry.install(adapter)
        await self._remove(unused)
        return adapter, previous.version if previous is not None else 0

    async def unload(self, name: str) -> LoadedAdapter:
        registry = self._enabled()
        async with self._lock:
            adapter, unused = registry.unload(name)
        await self._remove(unused)
        return adapter

    async def read(self, name: str) -> AdapterCopy:
        """The adapter serving under ``name`` as a peer would load it (its version too)."""
        registry = self._enabled()
        async with self._lock:  # so no replacement removes its files while they are read
            adapter = registry.named(name)
            tensors = await asyncio.to_thread(read_tensors, adapter.path)
        spec = AdapterSpec(
            name=name, config_json=json.dumps(adapter.config.raw), version=adapter.version
        )
        return AdapterCopy(spec, tensors)

    def serving(self) -> list[LoadedAdapter]:
        return [] if self._registry is None else self._registry.serving()

    def begin(self, name: str) -> LoadedAdapter | None:
        """The adapter version a new request named ``name`` runs on (None: the base model),
        counted as running until ``end``. An unknown name is NOT_FOUND, LoRA served or not
        (the HTTP edge answers 404 from it)."""
        if not name:
            return None
        if self._registry is None:
            raise NotFound(
                f"no LoRA adapter named {name!r}: this server does not serve LoRA adapters "
                "(start it with --enable-lora)"
            )
        return self._registry.begin(name)

    def end(self, adapter: LoadedAdapter | None) -> None:
        if adapter is None or self._registry is None:
            return
        unused = self._registry.end(adapter)
        if unused:
            task = asyncio.ensure_future(self._remove(unused))
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)

    async def _remove(self, adapters: list[LoadedAdapter]) -> None:
        """Drops versions no request uses any more from the engine and from disk."""
        for adapter in adapters:
            try:
                await self._calls.remove(adapter.vllm_id)
            except Exception:  # already evicted from the engine's cache: nothing to remove
                log.debug("adapter %s v%d was not in the engine", adapter.name, adapter.version)
        if self._registry is not None:
            self._registry.discard(adapters)

    def close(self) -> None:
        if self._registry is not None:
            self._registry.close()
