"""``python -m testbed.routed_experts_source <serve's arguments>``: an engine server whose vLLM
hands routed experts over as it does on a GPU, for ``bench_routed_experts`` and the tests on
this CPU build, which cannot capture them ("AuxOutput Connector requires Model Runner V2").

Each step's ``EngineCoreOutput`` gets the routing of the tokens that step fed through the
model (the prompt's from its ``routed_experts_prompt_start`` on a request's first step, as the
engine core applies it, then a row per new token: the last output token gets none, as on a
GPU), distinct ids in a real MoE's shape (``ROUTED_EXPERTS_SHAPE``: layers,
experts per token, experts; Qwen3-30B-A3B's 48, 8, 128 by default), taken from a pool made
once so that making them costs the engine nothing. vLLM's own output processor then gathers
them as on a GPU; everything after it is the server's own. The server is started as with
``--enable-return-routed-experts``, minus vLLM's flag, which this CPU build refuses."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

SHAPE_ENVIRONMENT = "ROUTED_EXPERTS_SHAPE"
POOL_ROWS = 4096


def _pool(layers: int, per_token: int, experts: int) -> Any:
    """``POOL_ROWS`` rows of top-k routing, distinct ids per layer, in the engine's dtype."""
    rng = np.random.default_rng(0)
    order = np.argsort(rng.random((POOL_ROWS, layers, experts)), axis=2)[:, :, :per_token]
    return order.astype(np.uint8 if experts <= 256 else np.uint16)


def install() -> None:
    """Patches vLLM's output processor to receive routing, and the server's engine arguments
    to leave vLLM's flag out."""
    from vllm.v1.engine import output_processor

    from servers.engine.vllm_adapter import engine_args, vllm_engine

    layers, per_token, experts = (
        int(v) for v in os.environ.get(SHAPE_ENVIRONMENT, "48,8,128").split(",")
    )
    pool = _pool(layers, per_token, experts)
    taken = [0]

    def rows(count: int) -> Any:
        start = taken[0] % POOL_ROWS
        taken[0] += count
        if start + count <= POOL_ROWS:
            return pool[start : start + count]
        return np.concatenate([pool[start:], pool[: start + count - POOL_ROWS]])

    original = output_processor.OutputProcessor.process_outputs
    original_add = output_processor.OutputProcessor.add_request
    # Each request's routed_experts_prompt_start, which the engine core applies on a GPU.
    prompt_starts: dict[str, int] = {}

    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        params = request.sampling_params
        prompt_starts[request.request_id] = params.routed_experts_prompt_start if params else 0
        return original_add(self, request, *args, **kwargs)

    def process_outputs(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        for output in engine_core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None or not output.new_token_ids:
                continue
            if not state.routed_experts_chunks:  # the first step: the prompt, from its start
                start = prompt_starts.pop(output.request_id, 0)
                fed = len(state.prompt_token_ids or ()) - start
            else:
                fed = len(output.new_token_ids)
            output.routed_experts = rows(fed)
        return original(self, engine_core_outputs, *args, **kwargs)

    output_processor.OutputProcessor.add_request = add_request  # type: ignore[method-assign]
    output_processor.OutputProcessor.process_outputs = process_outputs  # type: ignore[method-assign]

    def without_vllms_flag(*args: Any, **kwargs: Any) -> Any:
        made = engine_args.engine_arguments(*args, **kwargs)
        made.args.pop("enable_return_routed_experts", None)
        return made

    vllm_engine.engine_arguments = without_vllms_flag  # type: ignore[attr-defined]


if __name__ == "__main__":
    install()
    from servers.engine.process.engine_server import main

    main()
