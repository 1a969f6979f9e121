"""vLLM's own OpenAI HTTP server on the embedded model (or another), with the engine settings
this stack's engine server uses: the reference for the HTTP edge's compatibility tests. One
launcher with the benchmarks' (``testbed.peers.vllm_http_server``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from testbed.peers import SERVED_NAME
from testbed.peers import vllm_http_server as launch

__all__ = ["SERVED_NAME", "vllm_http_server"]


@contextlib.contextmanager
def vllm_http_server(
    stream_interval: int = 1, model: Path | None = None, extra_args: tuple[str, ...] = ()
) -> Iterator[str]:
    """vLLM's server on ``model`` (default: the embedded one), with ``extra_args`` on its
    command line; yields its base URL."""
    with launch(stream_interval, model, extra_args) as launched:
        yield launched.address
