"""One checkpoint copy per server, however many tensor-parallel workers it has.

Each worker of a tensor-parallel engine reloads its own shard, and vLLM's weight loaders take
whole checkpoint tensors (each worker cuts its shard out). Rather than every worker keeping a
full checkpoint-format copy of the serving weights, TP rank 0 keeps it (stages, patches, undo
records) and, when an update is applied, streams the tensors of the layers to reload to the
other ranks over the tensor-parallel group's CPU (gloo) group, one tensor at a time, in the
order every rank's ``load_weights`` consumes them. The others hold a tensor only while their
loader uses it. Without tensor parallelism nothing is sent.

The plan (which tensors, their types and shapes) crosses as JSON bytes: no pickle.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch

# A reload plan: (checkpoint name, torch element type name, shape) of each tensor, in order.
Plan = list[tuple[str, str, list[int]]]


class TensorParallelShare:
    """The tensor-parallel group of this worker, as the copy's holder (TP rank 0) or a peer."""

    def __init__(self) -> None:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        self.size = int(group.world_size)
        self.holds_copy = int(group.rank_in_group) == 0
        self._source = int(group.ranks[0])  # TP rank 0's global rank
        self._group = group.cpu_group

    def agree(self, plan: Plan | None) -> Plan:
        """The holder's ``plan``, on every rank (peers pass None)."""
        if self.size == 1:
            return plan or []
        payload = json.dumps(plan or []).encode() if self.holds_copy else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self._broadcast(size)
        raw = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if self.holds_copy and payload
            else torch.empty(int(size.item()), dtype=torch.uint8)
        )
        if raw.numel():
            self._broadcast(raw)
        rows = json.loads(raw.numpy().tobytes() or b"[]")
        return [(name, dtype, list(shape)) for name, dtype, shape in rows]

    def stream(
        self, plan: Plan, weights: dict[str, Any] | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The plan's tensors: the holder's own (sent to the peers as they are taken), or those
        received from it."""
        for name, dtype, shape in plan:
            if self.holds_copy:
                assert weights is not None
                tensor = weights[name].contiguous()
            else:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            if self.size > 1:  # as bytes: gloo need not know the element type
                self._broadcast(tensor.view(-1).view(torch.uint8))
            yield name, tensor

    def _broadcast(self, tensor: torch.Tensor) -> None:
        torch.distributed.broadcast(tensor, src=self._source, group=self._group)
