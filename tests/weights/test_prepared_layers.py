"""Layers prepared ahead of a commit (``servers/engine/worker/prepared_layers.py``): what a
reload makes of a module is set aside while the module keeps serving, and swapped in at the
commit; which layers are ready, which went stale, which the commit must reload.

The reload here is the part of vLLM's layerwise reload the module hooks: a module's tensors
replaced and its kernel attribute set, then ``_copy_and_restore_kernel_tensors`` called as
vLLM's ``_layerwise_process`` calls it. The engine tests (``test_weight_transfer``,
``test_weight_deltas``) run the whole reload on real servers."""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.model_loader.reload import layerwise

from servers.engine.worker.prepared_layers import PreparedLayers, set_aside, setting_aside


class Linear(torch.nn.Module):
    processed = False  # an attribute vLLM's processing may set

    def __init__(self, value: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((2, 2), value), requires_grad=False)
        self.kernel: Any = ("packed", value)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Linear(1.0)
        self.second = Linear(2.0)


def reloaded(layer: Linear, value: float) -> None:
    """What vLLM's reload does to ``layer``: new tensors and kernels, then the hook."""
    layer.weight = torch.nn.Parameter(torch.full((2, 2), value), requires_grad=False)
    layer.kernel = ("packed", value)
    layer.processed = True
    no_info: Any = None  # the hook set aside reads none of vLLM's bookkeeping
    layerwise._copy_and_restore_kernel_tensors(layer, no_info)


def test_a_reload_set_aside_leaves_the_module_serving_until_the_swap() -> None:
    model = Model()
    serving = model.first.weight
    with set_aside(model) as unit:
        assert setting_aside()
        reloaded(model.first, 5.0)
    assert not setting_aside()
    assert layerwise._copy_and_restore_kernel_tensors is not None
    # Still serving what it served: the same tensor object, its values and kernel untouched.
    assert model.first.weight is serving and float(serving[0, 0]) == 1.0
    assert model.first.kernel == ("packed", 1.0) and not model.first.processed
    assert unit.swappable and len(unit.swaps) == 1
    unit.swaps[0].apply()
    assert float(model.first.weight[0, 0]) == 5.0 and model.first.kernel == ("packed", 5.0)
    assert model.first.processed
    assert float(serving[0, 0]) == 1.0  # the old tensor was never written
    assert float(model.second.weight[0, 0]) == 2.0  # a module the reload left alone


def test_the_hook_is_vllms_own_again_after_the_reload_even_when_it_failed() -> None:
    original = layerwise._copy_and_restore_kernel_tensors
    model = Model()
    try:
        with set_aside(model):
            raise RuntimeError("reload broke")
    except RuntimeError:
        pass
    assert layerwise._copy_and_restore_kernel_tensors is original
    assert not setting_aside()


def test_a_module_sharing_a_tensor_with_another_is_not_swapped() -> None:
    """Tied tensors (an embedding and the LM head): a swap would untie them, so the commit
    reloads such a layer in place."""
    model = Model()
    model.second.weight = model.first.weight
    with set_aside(model) as unit:
        reloaded(model.first, 5.0)
    assert not unit.swappable
    assert model.second.weight is model.first.weight


def test_which_layers_are_ready_stale_and_reloaded_at_the_commit() -> None:
    groups = [["a.0.w", "a.0.b"], ["a.1.w"], ["head"]]
    prepared = PreparedLayers(enabled=True)
    prepared.arrived(["a.0.w"])
    assert prepared.ready(groups) == []  # half a layer
    prepared.arrived(["a.0.b", "a.1.w"])
    assert prepared.ready(groups) == ["a.0.w", "a.0.b", "a.1.w"]
    model = Model()
    with set_aside(model) as first:
        reloaded(model.first, 5.0)
    first.names = frozenset(["a.0.w", "a.0.b"])
    prepared.add(first)
    with set_aside(model) as second:
        reloaded(model.second, 6.0)
    second.names = frozenset(["a.1.w"])
    prepared.add(second)
    assert prepared.ready(groups) == []  # prepared already
    # A tensor of the second unit staged again: that unit is reloaded at the commit.
    prepared.arrived(["a.1.w", "head"])
    everything = {"a.0.w", "a.0.b", "a.1.w", "head"}
    assert prepared.to_reload(everything) == {"a.1.w", "head"}
    swapped = prepared.swap_in(lambda name: name in {"a.1.w", "head"})
    assert swapped == 1
    assert model.first.kernel == ("packed", 5.0)
    assert model.second.kernel == ("packed", 2.0)  # left to the commit's reload
    assert prepared.units == [] and prepared.to_reload(everything) == everything


def test_nothing_is_ready_where_preparing_is_off() -> None:
    prepared = PreparedLayers(enabled=False)
    prepared.arrived(["a.0.w"])
    assert prepared.ready([["a.0.w"]]) == []
