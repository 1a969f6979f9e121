"""Routed experts handed over step by step, as the engine captures them.

vLLM's engine core sends each step's routing with the step's output (``EngineCoreOutput.
routed_experts``: a row per token it fed through the model); its output processor keeps them
in the request's state (``RequestState.routed_experts_chunks``) and hands them over only on
the finished output, concatenated (``CompletionOutput.routed_experts``). A stream then carries
no routing until its end, and a stream cut mid-way (its server lost) none of its tokens'.

``RoutedExpertsSteps`` gives each of a request's outputs the rows gathered since the previous
one it saw: read from the request's states right after the output was taken (on the engine's
loop, where the output processor runs: the chunks then match the steps the output holds, a
merged backlog's included), and on the finished output the rows of the whole array not handed
over yet. Concatenated in order, a sample's rows are vLLM's own array.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class RoutedExpertsSteps:
    """One request's routed experts, step by step (``attach``), read from vLLM's output
    ``processor`` (an ``OutputProcessor``)."""

    def __init__(self, processor: Any, request_id: str) -> None:
        self._processor = processor
        self._request_id = request_id
        # Per sample index: chunks of the request's state handed over, and rows.
        self._chunks: dict[int, int] = {}
        self._rows: dict[int, int] = {}

    def _state(self, index: int) -> Any:
        """The state of sample ``index`` (a child request's with n > 1), or None once ended."""
        states = self._processor.request_states
        for internal in self._processor.external_req_ids.get(self._request_id, ()):
            state = states.get(internal)
            if state is not None and state.request_index == index:
                return state
        return None

    def attach(self, output: Any) -> Any:
        """``output`` (a ``RequestOutput``) with each completion's ``routed_experts`` set to
        its rows not handed over before (None: none new)."""
        for completion in output.outputs:
            index = completion.index
            given = self._rows.get(index, 0)
            whole = completion.routed_experts
            if whole is not None:  # finished: vLLM's whole array, less what went before
                completion.routed_experts = whole[given:] if len(whole) > given else None
                self._rows[index] = max(given, len(whole))
                continue
            state = self._state(index)
            if state is None:
                continue
            chunks = state.routed_experts_chunks
            taken = self._chunks.get(index, 0)
            if len(chunks) <= taken:
                continue
            new = chunks[taken:]
            rows = new[0] if len(new) == 1 else np.concatenate(new, axis=0)
            self._chunks[index] = len(chunks)
            self._rows[index] = given + len(rows)
            completion.routed_experts = rows
        return output
