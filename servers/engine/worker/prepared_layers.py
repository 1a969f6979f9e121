"""New weights made ready to serve while the update still arrives, so its commit swaps them in.

Where a commit's time goes on a CPU engine: vLLM's layerwise reload of the layers the update
touched, about 45% of it repacking linear weights (oneDNN) and 35% copying checkpoint tensors
into fused parameters (a 94M float32 model on one core: 0.2 s of a 0.5 s delta update). The
trainer waits for it, the engine serves nothing meanwhile, and servers sharing cores pay it one
after another. Here a decoder layer is reloaded as soon as every tensor of it has arrived, while
the rest still travel: vLLM's own reload runs, but what it makes of each module is set aside and
the module keeps serving its current tensors and kernels. The commit puts the set-aside ones in
place (attribute assignments), then reloads only what was not prepared.

Only where swapping is sound (``swap_is_sound``): a CPU engine in eager mode, where no CUDA graph
or compiled code holds on to the tensors it was captured with (a reload elsewhere copies into the
old tensors' storage for that reason), and a module none of whose tensors another module shares:
a layer holding one (tied embeddings) reloads at the commit, in place, as before.

What it costs: the prepared layers' new tensors beside the serving ones until the commit (one
more copy of the model's serving weights, for a full update), and the reloads compete with the
transfer for the cores (on the testbed, eight servers sharing two cores took 1.45x the floor for a
full update against 1.29x reloading at the commit; four: 1.08x against 1.11x). Hence opt-in: the
server's ``--weight-commit-prepare``, for servers with cores of their own behind a slower link.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.model_executor.model_loader.reload import layerwise

_TENSOR_SLOTS = ("_parameters", "_buffers", "_non_persistent_buffers_set")
_ABSENT = object()
_active = [0]  # set_aside contexts open (the engine core runs one at a time)


def setting_aside() -> bool:
    """Whether a reload running now is set aside (``set_aside``)."""
    return _active[0] > 0


def swap_is_sound(device: torch.device, enforce_eager: bool) -> bool:
    return device.type == "cpu" and enforce_eager


def _state(module: torch.nn.Module) -> dict[str, Any]:
    """The module's attributes, its tensor tables copied (a reload changes them in place)."""
    state = dict(module.__dict__)
    for slot in _TENSOR_SLOTS:
        state[slot] = type(state[slot])(state[slot])
    return state


def _tensor_ids(state: dict[str, Any]) -> Iterator[int]:
    """The ids of the tensors a module's ``_state`` holds."""
    for table in (state["_parameters"], state["_buffers"]):
        yield from (id(tensor) for tensor in table.values() if tensor is not None)


def _put(module: torch.nn.Module, state: dict[str, Any]) -> None:
    module.__dict__.clear()
    module.__dict__.update(state)


@dataclass
class _Swap:
    """What a reload made of one module, as a change to its serving attributes."""

    module: torch.nn.Module
    tensors: dict[str, Any]  # the module's new tensor tables
    changed: dict[str, Any]  # other attributes the processing set (kernels: ``cpu_linear``)
    removed: list[str]  # attributes it deleted

    @classmethod
    def between(
        cls, module: torch.nn.Module, before: dict[str, Any], after: dict[str, Any]
    ) -> _Swap:
        tensors = {slot: after[slot] for slot in _TENSOR_SLOTS}
        changed = {
            key: value
            for key, value in after.items()
            if key not in _TENSOR_SLOTS and before.get(key, _ABSENT) is not value
        }
        removed = [key for key in before if key not in after]
        return cls(module, tensors, changed, removed)

    def apply(self) -> None:
        attributes = self.module.__dict__
        for key in self.removed:
            attributes.pop(key, None)
        attributes.update(self.changed)
        attributes.update({slot: type(t)(t) for slot, t in self.tensors.items()})


@dataclass
class PreparedUnit:
    """The layers one preparation reloaded: swapped in whole at the commit, or not at all."""

    names: frozenset[str]
    swaps: list[_Swap] = field(default_factory=list)
    swappable: bool = True


@contextmanager
def set_aside(model: torch.nn.Module) -> Iterator[PreparedUnit]:
    """Within it, vLLM's layerwise reload of ``model`` leaves every module serving what it
    served: each module the reload processes is put back as it was, and what the reload made of
    it is kept in the unit yielded (not swappable when one of its tensors is another module's
    too). The unit's ``names`` are set by the caller."""
    before = {module: _state(module) for module in model.modules()}
    owners: dict[int, int] = {}  # by tensor id: how many modules hold it
    for state in before.values():
        for tensor_id in _tensor_ids(state):
            owners[tensor_id] = owners.get(tensor_id, 0) + 1
    unit = PreparedUnit(frozenset())

    def keep_aside(layer: torch.nn.Module, info: Any) -> None:
        old = before[layer]
        shares = any(owners[tensor_id] > 1 for tensor_id in _tensor_ids(old))
        unit.swappable = unit.swappable and not shares
        unit.swaps.append(_Swap.between(layer, old, _state(layer)))
        _put(layer, old)

    original = layerwise._copy_and_restore_kernel_tensors
    layerwise._copy_and_restore_kernel_tensors = keep_aside
    _active[0] += 1
    try:
        yield unit
    finally:
        _active[0] -= 1
        layerwise._copy_and_restore_kernel_tensors = original


class PreparedLayers:
    """The open update's layers prepared so far, on one worker (every tensor-parallel rank keeps
    its own, prepared in lockstep from the holder's plan).

    The holder (TP rank 0) also tracks what has arrived: ``arrived`` after each staging call,
    ``ready`` for the groups now complete and not yet prepared, ``stale`` when a prepared tensor
    is staged again (that unit then reloads at the commit)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.units: list[PreparedUnit] = []
        self._arrived: set[str] = set()
        self._prepared: set[str] = set()
        self._stale: set[str] = set()

    def clear(self) -> None:
        self.units = []
        self._arrived = set()
        self._prepared = set()
        self._stale = set()

    def arrived(self, names: Iterable[str]) -> None:
        if not self.enabled:  # nothing will be prepared: nothing to track
            return
        names = set(names)
        self._stale |= names & self._prepared
        self._arrived |= names

    def ready(self, groups: list[list[str]]) -> list[str]:
        """The names of every group complete in this update and not prepared yet."""
        return [
            name
            for group in groups
            if self._arrived.issuperset(group) and self._prepared.isdisjoint(group)
            for name in group
        ]

    def add(self, unit: PreparedUnit) -> None:
        self.units.append(unit)
        self._prepared |= unit.names

    def to_reload(self, names: set[str]) -> set[str]:
        """Of the update's ``names``, those the commit must reload (holder): all but the units
        still as prepared, swappable ones."""
        kept: set[str] = set()
        for unit in self.units:
            if unit.swappable and unit.names.isdisjoint(self._stale):
                kept |= unit.names
        return names - kept

    def swap_in(self, reloaded: Callable[[str], bool]) -> int:
        """Puts in place every unit none of whose names the commit reloads (every rank decides
        alike from the agreed plan); returns the modules swapped. The prepared units are then
        done with."""
        swapped = 0
        for unit in self.units:
            if unit.swappable and not any(reloaded(name) for name in unit.names):
                for swap in unit.swaps:
                    swap.apply()
                swapped += len(unit.swaps)
        self.clear()
        return swapped
