"""Which adapter versions a server holds: the one serving under each name, older ones still
running requests, and the ids vLLM knows them by. Pure bookkeeping (files only in its own
staging directory)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from servers.engine.domain.lora_adapters.checks import AdapterConfig
from skyrl_grpc.errors import FailedPrecondition, NotFound


@dataclass
class LoadedAdapter:
    """One version of an adapter as vLLM holds it."""

    name: str
    version: int
    vllm_id: int  # vLLM's lora_int_id: unique per version
    path: Path
    config: AdapterConfig
    source: str
    sha256: bytes
    owned: bool  # the directory is the server's staging copy, removed with the version
    running: int = 0  # requests generating with this version


@dataclass
class AdapterRegistry:
    """Names -> the adapter version serving now, and versions still running requests.

    ``staging``: the directory the server owns for in-band adapters (removed with the
    registry). ``max_adapters``: how many names may be loaded (--max-cpu-loras).
    """

    max_adapters: int
    staging: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="skyrl-lora-")))
    _serving: dict[str, LoadedAdapter] = field(default_factory=dict)
    _retired: dict[int, LoadedAdapter] = field(default_factory=dict)  # vllm_id -> old version
    _next_id: int = 1

    def staging_dir(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{_safe(name)}-", dir=self.staging))

    def next_version(self, name: str, requested: int) -> int:
        current = self._serving.get(name)
        floor = current.version if current is not None else 0
        if requested and requested <= floor:
            raise FailedPrecondition(
                f"adapter {name!r} version {requested} is not newer than the version serving "
                f"({floor}): use a larger version, or 0 for the next one"
            )
        if current is None and len(self._serving) >= self.max_adapters:
            raise FailedPrecondition(
                f"{len(self._serving)} adapters are loaded, this server's limit "
                f"(--max-cpu-loras): unload one first ({', '.join(sorted(self._serving))})"
            )
        return requested or floor + 1

    def allocate_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def install(self, adapter: LoadedAdapter) -> tuple[LoadedAdapter | None, list[LoadedAdapter]]:
        """Makes ``adapter`` the serving version of its name; returns the version it replaced
        and the versions now unused (to remove from vLLM and disk)."""
        previous = self._serving.get(adapter.name)
        self._serving[adapter.name] = adapter
        if previous is not None:
            self._retired[previous.vllm_id] = previous
        return previous, self._collect()

    def unload(self, name: str) -> tuple[LoadedAdapter, list[LoadedAdapter]]:
        adapter = self._serving.pop(name, None)
        if adapter is None:
            raise NotFound(f"no adapter named {name!r} is loaded{self._names()}")
        self._retired[adapter.vllm_id] = adapter
        return adapter, self._collect()

    def named(self, name: str) -> LoadedAdapter:
        """The version serving under ``name`` now."""
        adapter = self._serving.get(name)
        if adapter is None:
            raise NotFound(f"no LoRA adapter named {name!r}{self._names()}")
        return adapter

    def begin(self, name: str) -> LoadedAdapter:
        """The version a new request named ``name`` runs on (counted until ``end``)."""
        adapter = self.named(name)
        adapter.running += 1
        return adapter

    def end(self, adapter: LoadedAdapter) -> list[LoadedAdapter]:
        adapter.running -= 1
        return self._collect()

    def serving(self) -> list[LoadedAdapter]:
        return [self._serving[name] for name in sorted(self._serving)]

    def _collect(self) -> list[LoadedAdapter]:
        done = [a for a in self._retired.values() if a.running <= 0]
        for adapter in done:
            del self._retired[adapter.vllm_id]
        return done

    def _names(self) -> str:
        names = sorted(self._serving)
        return f"; loaded: {', '.join(names)}" if names else "; none is loaded"

    def discard(self, adapters: Iterable[LoadedAdapter]) -> None:
        """Removes the staging copies of versions no longer used."""
        for adapter in adapters:
            if adapter.owned:
                shutil.rmtree(adapter.path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40] or "adapter"
