"""A fault for tests: vLLM's layerwise reload breaks part-way through the weights, on demand.

vLLM's CPU platform spawns its engine core (and, above TP=1, its workers), so a test cannot
patch them from its own process. This module is a vLLM general plugin instead:
``plugin_directory`` writes a distribution whose ``vllm.general_plugins`` entry point is
``install``; with that directory on ``sys.path`` when a server starts its engine (the processes
vLLM spawns get this process's ``sys.path`` and load every general plugin they find), each one
wraps the weight-transfer engine's ``reload_weights``. The wrapper breaks a reload after a few
tensors (some layers reloaded, the rest not) when the trigger file named by ``TRIGGER`` in the
environment holds a line naming its tensor-parallel rank (or ``any``) and when the reload runs
(``prepare``: a layer prepared as its tensors arrive, ``prepared_layers``; ``commit``; ``any``);
the first to break removes that line, so one reload breaks per line armed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

# The environment variable naming the trigger file.
TRIGGER = "SKYRL_TEST_RELOAD_FAULT"
# Tensors the broken reload takes before it raises.
BROKEN_AFTER = 8
MESSAGE = "reload broke part-way (injected)"


def install() -> None:
    if TRIGGER not in os.environ:
        return
    from servers.engine.worker import transfer_engine

    engine: Any = transfer_engine  # its reload_weights is vLLM's, imported there
    real = engine.reload_weights

    def breakable(*args: Any, weights_iterator: Iterable[Any], **kwargs: Any) -> None:
        if _triggered():
            weights_iterator = _broken_after(weights_iterator, BROKEN_AFTER)
        real(*args, weights_iterator=weights_iterator, **kwargs)

    engine.reload_weights = breakable


def arm(trigger: Path, rank: int | None = None, during: str = "any") -> None:
    """Breaks the next reload on ``rank`` (None: whichever reloads first) that runs
    ``during`` (``prepare``, ``commit`` or ``any``); arming again adds one more."""
    with trigger.open("a") as lines:
        lines.write(f"{'any' if rank is None else rank} {during}\n")


def _triggered() -> bool:
    from vllm.distributed import get_tensor_model_parallel_rank

    from servers.engine.worker.prepared_layers import setting_aside

    path = Path(os.environ[TRIGGER])
    try:
        armed = path.read_text().splitlines()
    except FileNotFoundError:
        return False
    now = "prepare" if setting_aside() else "commit"
    for index, line in enumerate(armed):
        rank, during = line.split()
        if rank in ("any", str(get_tensor_model_parallel_rank())) and during in ("any", now):
            rest = armed[:index] + armed[index + 1 :]  # one reload breaks per line
            if rest:
                path.write_text("".join(f"{kept}\n" for kept in rest))
            else:
                path.unlink(missing_ok=True)
            return True
    return False


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
