"""vLLM's layerwise reload logs a warning for every layer a reload leaves as it was; a reload
of the layers an update touched leaves the others so on purpose (``transfer_engine``), so those
loggers are raised to ERROR while it runs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


@contextmanager
def quiet_reload_logs(names: tuple[str, ...] = RELOAD_LOGGERS) -> Iterator[None]:
    """Raises the named loggers to ERROR while the block runs."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
