"""One checkpoint copy per server, however many tensor-parallel workers it has.

Each worker of a tensor-parallel engine reloads its own shard, and vLLM's weight loaders take
whole checkpoint tensors (each worker cuts its shard out). Rather than every worker keeping a
full checkpoint-format copy of the serving weights, TP rank 0 keeps it (stages, patches, undo
records) and, when an update is applied, streams the tensors of the layers to reload to the
other ranks over the tensor-parallel group's CPU (gloo) group, one tensor at a time, in the
order every rank's ``load_weights`` consumes them. The others hold a tensor only while their
loader uses it. Without tensor parallelism nothing is sent.

The plan (which tensors, their types and shapes) crosses as JSON bytes: no pickle.

The ranks reload in lockstep, so a rank whose reload fails must not leave the others waiting in
a broadcast for a tensor that never comes: before every tensor (and after the last) the ranks
agree that all are still going, and after the reload on its outcome (``outcome``): one failure
anywhere and every rank restores the previous weights together.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch

# A reload plan: (checkpoint name, torch element type name, shape) of each tensor, in order.
Plan = list[tuple[str, str, list[int]]]


class StreamAborted(RuntimeError):
    """Another tensor-parallel rank failed while reloading: this one stopped with it."""


class TensorParallelShare:
    """The tensor-parallel group of this worker, as the copy's holder (TP rank 0) or a peer.

    ``group``: (size, this rank's place in it, TP rank 0's global rank, the CPU process group);
    None: this worker's vLLM tensor-parallel group."""

    def __init__(self, group: tuple[int, int, int, Any] | None = None) -> None:
        if group is None:
            from vllm.distributed import get_tp_group

            tp = get_tp_group()
            group = (int(tp.world_size), int(tp.rank_in_group), int(tp.ranks[0]), tp.cpu_group)
        self.size, rank, self._source = group[0], group[1], group[2]
        self._group: Any = group[3]
        self.holds_copy = rank == 0
        self._streamed = False  # the last stream gave every tensor
        self._aborted = False  # the last stream stopped because another rank failed

    def agree(self, plan: Plan | None) -> Plan:
        """The holder's ``plan``, on every rank (peers pass None). Starts a reload."""
        self._streamed = self._aborted = False
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
        received from it. Raises ``StreamAborted`` when another rank failed meanwhile."""
        for name, dtype, shape in plan:
            self._all_going()
            if self.holds_copy:
                assert weights is not None
                tensor = weights[name].contiguous()
            else:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            if self.size > 1:  # as bytes: gloo need not know the element type
                self._broadcast(tensor.view(-1).view(torch.uint8))
            yield name, tensor
        self._all_going()
        self._streamed = True

    def outcome(self, ok: bool) -> bool:
        """Whether the reload succeeded on every rank, given this rank's ``ok``. A rank that
        failed mid-stream first releases the others (they wait for its next tensor)."""
        if self.size == 1:
            return ok
        if not ok and not self._aborted and not self._streamed:
            self._agree(False)
        return self._agree(ok)

    def _all_going(self) -> None:
        if self.size > 1 and not self._agree(True):
            self._aborted = True
            raise StreamAborted("another tensor-parallel rank failed while reloading")

    def _agree(self, ok: bool) -> bool:
        """True when every rank says ``ok``."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        torch.distributed.broadcast(tensor, src=self._source, group=self._group)
