"""A worker's copy of the serving weights in checkpoint format, and what an open update changed.

On CPU vLLM repacks weights after loading, so new weights reach the model through
``reload_weights`` of complete checkpoint tensors (fused q/k/v and gate/up included): the worker
keeps the serving weights as the checkpoint holds them, first read from its safetensors files.

An update either stages whole new tensors (held beside the serving ones until the commit) or
patches elements in place: a patch writes its new values into the serving copy at once and
records what it overwrote, so its memory is O(changed), never a clone of the parameter.
Cancelling replays those records backwards. After a commit the records of the last update (and
the tensors whole values replaced) are kept until the next update starts, so a rollback restores
the previous weights exactly: for a delta that costs what it overwrote.

Whole values arrive into recycled tensors (``buffer_for``): the ones the rollback kept, once the
next update starts, or ones a cancelled update staged. A full update every step then reuses the
same two copies of the model instead of allocating a new one each time, which fragments the
heap (the engine server keeps freed memory mapped: ``skyrl_grpc.host_memory``) and page-faults
through fresh memory. What the update that follows does not reuse is dropped at its commit.

Plain tensors only (no vLLM): ``worker`` loads the result into the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servers.engine.worker.shared_copy import SharedCopy


def read_checkpoint(files: list[Any], model: str) -> tuple[dict[str, Any], SharedCopy | None]:
    """The serving weights as the checkpoint's safetensors ``files`` hold them, copied into
    shared memory the other tensor-parallel ranks read (``shared_copy``), or into this process's
    own memory where none can be made."""
    from safetensors.torch import load_file

    from servers.engine.worker.shared_copy import copied

    # load_file maps the files: their tensors would be read at the first reload and copied
    # page by page at the first write (patches, or a full update reusing them: ~0.7 GB of
    # page faults in the second update of a 0.3B bf16 model). Copied into memory of their
    # own now, once, while the engine starts.
    mapped: dict[str, Any] = {}
    for path in files:
        mapped.update(load_file(str(path), device="cpu"))
    if not mapped:
        raise RuntimeError(f"no safetensors weights in {model} to update")
    return copied(mapped)


def bits_of(itemsize: int) -> Any:
    """The integer type of an element size (``dtypes.BITS_BY_ITEMSIZE``): a patch writes bits,
    never float values."""
    import torch

    from skyrl_grpc.dtypes import BITS_BY_ITEMSIZE

    return getattr(torch, BITS_BY_ITEMSIZE[itemsize])


def flat_bits(tensor: Any) -> Any:
    """A contiguous tensor's elements as integers of the same size (a view: writes go through)."""
    return tensor.view(-1).view(bits_of(tensor.element_size()))


def _scatter(flat: Any, indices: Any, values: Any) -> None:
    """``flat[indices] = values`` through numpy (2x torch's advanced indexing here; indices
    out of range raise, though ``assembly.check_patch`` refused those already)."""
    import numpy as np

    np.put(flat.numpy(), indices.numpy(), values.numpy())


@dataclass
class _Overwritten:
    """What one patch replaced: the elements' indices and their previous bits."""

    name: str
    indices: Any
    old_bits: Any


@dataclass
class _Changes:
    """One update's changes to the serving copy: whole tensors replaced (their previous values
    after a commit, their new ones before) and patches applied in place, in order."""

    whole: dict[str, Any] = field(default_factory=dict)
    overwritten: list[_Overwritten] = field(default_factory=list)


class ServingCheckpoint:
    """The serving weights (checkpoint names → host tensors) with the open update's changes."""

    def __init__(self, load: Callable[[], dict[str, Any]], shared: SharedCopy | None = None):
        self._load = load
        # Where ``load`` put the serving tensors, with a second place for each (its spare):
        # then the other tensor-parallel ranks read the copy there (``shared_copy``).
        self.shared = shared
        self._tensors: dict[str, Any] | None = None
        self._open = _Changes()  # whole: the staged new values
        self._committed: _Changes | None = None  # whole: the values the commit replaced
        # Tensors no longer holding weights, for the next whole values of the same name.
        self._spare: dict[str, Any] = {}

    @property
    def tensors(self) -> dict[str, Any]:
        """The weights as the open update leaves them so far (patches in place, whole tensors
        not yet): read on first use."""
        if self._tensors is None:
            self._tensors = self._load()
        return self._tensors

    @property
    def staged_count(self) -> int:
        return len(self.open_names())

    def open_names(self) -> set[str]:
        """The parameters the open update changes."""
        return _names(self._open)

    def committed_names(self) -> set[str]:
        """The parameters the last commit changed (none once released or rolled back)."""
        return _names(self._committed) if self._committed is not None else set()

    def mark(self) -> tuple[dict[str, Any], int]:
        """A point the open update can be taken back to (``revert_to``): what was staged whole
        (a patch of a tensor staged whole in the same update is not undone: the update is
        rejected then)."""
        return dict(self._open.whole), len(self._open.overwritten)

    def revert_to(self, mark: tuple[dict[str, Any], int]) -> None:
        whole, count = mark
        self._open.whole = whole
        _undo(self.tensors, self._open.overwritten[count:])
        del self._open.overwritten[count:]

    def stage_whole(self, name: str, tensor: Any) -> None:
        self._open.whole[name] = tensor

    def prepare_spares(self) -> int:
        """Allocates and touches a spare tensor for every parameter that has none: a full
        update's whole values then go into memory the process already holds instead of
        faulting in fresh pages inside the trainer's first update (on the benchmark VM the
        faults cost more than the transfer). Returns the bytes allocated."""
        import torch

        allocated = 0
        for name, tensor in self.tensors.items():
            if name not in self._spare:
                spare = self._second_place(name)
                if spare is None:
                    spare = torch.zeros_like(tensor)
                else:
                    spare.zero_()  # touched: mapped now, not in the first update
                self._spare[name] = spare
                allocated += tensor.nbytes
        return allocated

    def buffer_for(self, name: str, shape: list[int], dtype: Any) -> Any:
        """A tensor to receive ``name``'s new whole value into: a spare one of its shape and
        type when there is one, else the second place the shared copy keeps for it, else a
        new one."""
        import torch

        spare = self._spare.pop(name, None)
        if spare is None:
            spare = self._second_place(name)
        if spare is not None and list(spare.shape) == list(shape) and spare.dtype == dtype:
            return spare
        return torch.empty(shape, dtype=dtype)

    def _second_place(self, name: str) -> Any:
        """The shared copy's place for ``name`` that its serving value does not occupy (None
        without a shared copy). Free whenever no spare is kept: the previous value a commit
        replaced becomes a spare when the next update starts, and is released otherwise."""
        serving = self.tensors.get(name)
        if self.shared is None or serving is None:
            return None
        kept = self._committed.whole.get(name) if self._committed is not None else None
        if kept is not None and self.shared.which(name, kept) is not None:
            return None  # it holds the previous value, for a rollback
        return self.shared.other(name, serving)

    def location(self, tensor: Any) -> int | None:
        """Where ``tensor`` lies in the shared copy (None: not there)."""
        return None if self.shared is None else self.shared.offset_of(tensor)

    def staged_whole(self, name: str) -> Any:
        """The new value staged for ``name`` (KeyError: none)."""
        return self._open.whole[name]

    def patch(
        self, name: str, names: Any, bitmap: bool, new_bits: Any, xor: bool = False
    ) -> tuple[Any, Any]:
        """Writes ``new_bits`` (numpy, the parameter's integer type) at the elements ``names``
        (the patch's name bytes: indices, or with ``bitmap`` a bitmap, as ``patch_format`` lays
        them out) of ``name`` (with ``xor``, the bits there XOR ``new_bits``: a compressed
        patch's values); returns the patched tensor and the changed elements' indices (numpy).
        ValueError, nothing written, where the names do not fit the parameter.

        A parameter staged whole in this update is patched in its staged buffer (nothing to
        record: it is new); otherwise the serving copy is written and what it held recorded."""
        import torch

        from servers.engine.worker.patch_kernels import apply_in_place

        staged = self._open.whole.get(name)
        tensor = staged if staged is not None else self.tensors[name]
        indices, old_bits = apply_in_place(flat_bits(tensor).numpy(), names, bitmap, new_bits, xor)
        if staged is None:
            record = _Overwritten(name, torch.from_numpy(indices), torch.from_numpy(old_bits))
            self._open.overwritten.append(record)
        return tensor, indices

    def pending(self) -> dict[str, Any]:
        """The complete checkpoint the open update makes."""
        return {**self.tensors, **self._open.whole}

    def discard(self) -> int:
        """Drops the open update; returns how many parameters it had changed."""
        count = self.staged_count
        _undo(self.tensors, self._open.overwritten)
        self._spare.update(self._open.whole)
        self._open = _Changes()
        return count

    def commit(self) -> int:
        """Makes the open update the serving weights, keeping what it replaced for a rollback."""
        count = self.staged_count
        tensors = self.tensors
        replaced = {name: tensors[name] for name in self._open.whole}
        tensors.update(self._open.whole)
        self._committed = _Changes(whole=replaced, overwritten=self._open.overwritten)
        self._open = _Changes()
        self._spare = {}  # what this update did not reuse is not needed
        return count

    def revert_commit(self) -> int:
        """Restores the weights from before the last commit; returns the parameters restored."""
        committed = self._committed
        if committed is None:
            raise RuntimeError("no previous weights kept: nothing to roll back")
        self.tensors.update(committed.whole)
        _undo(self.tensors, committed.overwritten)
        self._committed = None
        return len(_names(committed))

    @property
    def can_revert_commit(self) -> bool:
        return self._committed is not None

    def recycle_commit(self) -> None:
        """Forgets what the last commit replaced (a new update starts): its whole tensors
        become spares for the new values."""
        if self._committed is not None:
            self._spare.update(self._committed.whole)
        self._committed = None

    def free_commit(self) -> int:
        """Ends the last commit's rollback window (the fleet committed it): what it replaced
        and the spare tensors are dropped, not recycled; returns their bytes. The next update's
        whole values then go to new memory."""
        dropped = list(self._spare.values())
        if self._committed is not None:
            dropped += list(self._committed.whole.values())
            dropped += [o.old_bits for o in self._committed.overwritten]
        self._committed = None
        self._spare = {}
        if self.shared is not None:  # their memory goes back to the system, not just the heap
            self.shared.release(dropped)
        return sum(t.nbytes for t in dropped)

    def serving_value(self, name: str) -> Any:
        """``name`` as it serves now: without the open update's patches."""
        tensor = self.tensors[name]
        mine = [o for o in self._open.overwritten if o.name == name]
        if not mine:
            return tensor
        copy = tensor.clone()
        _undo({name: copy}, mine)
        return copy


def _names(changes: _Changes) -> set[str]:
    return set(changes.whole) | {o.name for o in changes.overwritten}


def _undo(tensors: dict[str, Any], overwritten: list[_Overwritten]) -> None:
    for record in reversed(overwritten):
        _scatter(flat_bits(tensors[record.name]), record.indices, record.old_bits)
