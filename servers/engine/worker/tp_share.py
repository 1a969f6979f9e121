"""One checkpoint copy per server, however many tensor-parallel workers it has.

Each worker of a tensor-parallel engine reloads its own shard, and vLLM's weight loaders take
whole checkpoint tensors (each worker cuts its shard out). Rather than every worker keeping a
full checkpoint-format copy of the serving weights, TP rank 0 keeps it (stages, patches, undo
records). When an update is applied, rank 0 tells the others which tensors to reload (the plan)
and where each lies in the shared memory holding the copy (``shared_copy``): every rank then
reads them there itself, and the ranks reload in parallel. A tensor not in shared memory (none
could be made, a small parameter of a collective bucket), or every tensor when a rank cannot map
rank 0's memory (another host), is streamed instead over the tensor-parallel group's CPU (gloo)
group, one at a time, in the order every rank's ``load_weights`` consumes them. Without tensor
parallelism nothing is sent.

The plan (which tensors, their types, shapes and places) crosses as JSON bytes: no pickle.

Streamed tensors go in lockstep, so a rank whose reload fails must not leave the others waiting
in a broadcast for a tensor that never comes: before every streamed tensor (and after the last
tensor) the ranks agree that all are still going, and after the reload on its outcome
(``outcome``): one failure anywhere and every rank restores the previous weights together.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from servers.engine.worker.shared_copy import SharedCopyReader


class Row(NamedTuple):
    """One tensor of a reload plan."""

    name: str  # its checkpoint name
    dtype: str  # torch's element type name
    shape: list[int]
    offset: int | None  # where it lies in the shared copy (None: it is streamed)


Plan = list[Row]  # in the order the ranks' loaders take them


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
        self._reader = SharedCopyReader()
        self._path = ""  # the shared copy every rank reads in this reload ("": none)

    def agree(self, plan: Plan | None, path: str = "") -> Plan:
        """The holder's ``plan`` and the ``path`` of its shared copy, on every rank (peers pass
        None and ""). Starts a reload: the ranks also agree whether all of them can read the
        copy (if one cannot, every tensor is streamed)."""
        self._streamed = self._aborted = False
        if self.size == 1:
            return plan or []
        header = {"path": path, "rows": plan or []}
        payload = json.dumps(header).encode() if self.holds_copy else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self._broadcast(size)
        raw = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if self.holds_copy and payload
            else torch.empty(int(size.item()), dtype=torch.uint8)
        )
        if raw.numel():
            self._broadcast(raw)
        header = json.loads(raw.numpy().tobytes() or b"{}")
        path = str(header.get("path", ""))
        readable = bool(path) and (self.holds_copy or not self._reader.why_unreadable(path))
        self._path = path if self._agree(readable) else ""
        return [Row(n, d, list(shape), o) for n, d, shape, o in header.get("rows", [])]

    def stream(
        self, plan: Plan, weights: dict[str, Any] | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The plan's tensors: the holder's own, or on the other ranks read from its shared
        copy, or received from it (streamed as the holder takes them). Raises
        ``StreamAborted`` when another rank failed meanwhile."""
        for name, dtype, shape, offset in plan:
            shared = bool(self._path) and offset is not None
            if self.holds_copy:
                assert weights is not None
                tensor = weights[name].contiguous()
            elif shared:
                assert offset is not None
                tensor = self._reader.tensor(self._path, offset, getattr(torch, dtype), shape)
            else:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            if self.size > 1 and not shared:
                self._all_going()
                # as bytes: gloo need not know the element type
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
