"""A fault for tests: vLLM's layerwise reload breaks part-way through the new weights, once.

vLLM's CPU platform spawns its engine core, so a test cannot patch it from its own process.
This module is a vLLM general plugin instead: ``plugin_directory`` writes a distribution whose
``vllm.general_plugins`` entry point is ``install``; with that directory on ``sys.path`` when a
server starts its engine, the engine core (spawned with this process's ``sys.path``, it loads
every general plugin it finds) wraps the weight-transfer engine's ``reload_weights`` so that its first call
raises after a few tensors: some layers already reloaded with the new weights, the rest not.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

# Tensors the broken reload takes before it raises.
BROKEN_AFTER = 8
MESSAGE = "reload broke part-way (injected)"


def install() -> None:
    from servers.engine.weights import transfer_engine

    real = transfer_engine.reload_weights
    calls = 0

    def failing_once(*args: Any, weights_iterator: Iterable[Any], **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            weights_iterator = _broken_after(weights_iterator, BROKEN_AFTER)
        real(*args, weights_iterator=weights_iterator, **kwargs)

    transfer_engine.reload_weights = failing_once


def _broken_after(weights: Iterable[Any], count: int) -> Iterator[Any]:
    for index, item in enumerate(weights):
        if index == count:
            raise RuntimeError(MESSAGE)
        yield item


def plugin_directory(directory: Path) -> Path:
    """``directory``, holding the plugin's distribution (put it on ``sys.path``)."""
    dist = directory / "skyrl_reload_fault-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: skyrl-reload-fault\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\nreload_fault = {__name__}:install\n"
    )
    return directory
