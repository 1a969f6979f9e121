"""The worker's checkpoint-format copy of the serving weights (``ServingCheckpoint``): patches
written in place with a record of what they overwrote, whole tensors staged beside, and exact
restores on cancel and rollback, without vLLM."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from servers.engine.worker.checkpoint import ServingCheckpoint, flat_bits
from servers.engine.worker.shared_copy import SharedCopy, SharedCopyReader, copied, layout_of
from skyrl_grpc import patch_format


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(4, 8, generator=generator).to(torch.bfloat16),
        "b": torch.randn(16, generator=generator),
    }


def snapshot(checkpoint: ServingCheckpoint) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in checkpoint.tensors.items()}


def same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(
        torch.equal(flat_bits(left[n]), flat_bits(right[n])) for n in left
    )


def named(indices: list[int]) -> np.ndarray:
    """A patch's names for ``indices``: little-endian uint32s, as bytes."""
    return np.array(indices, dtype="<u4").view(np.uint8)


def patch(checkpoint: ServingCheckpoint, name: str, indices: list[int], value: float) -> None:
    tensor = checkpoint.tensors[name]
    new = torch.full((len(indices),), value, dtype=tensor.dtype)
    checkpoint.patch(name, named(indices), False, flat_bits(new).numpy())


def test_a_patch_writes_in_place_and_a_cancel_restores_every_bit() -> None:
    checkpoint = ServingCheckpoint(weights)
    before = snapshot(checkpoint)
    storage = checkpoint.tensors["a"].data_ptr()
    patch(checkpoint, "a", [0, 5], 2.0)
    patch(checkpoint, "a", [5, 7], 3.0)  # the same element twice in one update
    assert checkpoint.tensors["a"].data_ptr() == storage  # no clone of the parameter
    assert checkpoint.tensors["a"].view(-1)[[0, 5, 7]].tolist() == [2.0, 3.0, 3.0]
    # What serves meanwhile is the value before the update.
    assert torch.equal(checkpoint.serving_value("a"), before["a"])
    assert checkpoint.staged_count == 1
    assert checkpoint.discard() == 1
    assert same(snapshot(checkpoint), before)


def test_a_commit_keeps_what_it_replaced_until_released_and_rolls_back_exactly() -> None:
    checkpoint = ServingCheckpoint(weights)
    before = snapshot(checkpoint)
    checkpoint.stage_whole("b", torch.zeros(16))
    patch(checkpoint, "a", [1], -1.0)
    pending = checkpoint.pending()
    assert torch.equal(pending["b"], torch.zeros(16))
    assert pending["a"].view(-1)[1].item() == -1.0
    assert checkpoint.commit() == 2
    after = snapshot(checkpoint)
    assert torch.equal(after["b"], torch.zeros(16))
    assert checkpoint.revert_commit() == 2
    assert same(snapshot(checkpoint), before)
    # Rolled back once: nothing more is kept.
    assert not checkpoint.can_revert_commit


def test_a_patch_of_a_tensor_staged_whole_patches_the_staged_value() -> None:
    checkpoint = ServingCheckpoint(weights)
    before = snapshot(checkpoint)
    checkpoint.stage_whole("b", torch.ones(16))
    patch(checkpoint, "b", [3], 9.0)
    assert checkpoint.pending()["b"][3].item() == 9.0
    assert same(snapshot(checkpoint), before)  # the serving copy untouched


def test_revert_to_a_mark_drops_only_what_came_after() -> None:
    checkpoint = ServingCheckpoint(weights)
    patch(checkpoint, "a", [0], 4.0)
    after_first = snapshot(checkpoint)
    mark = checkpoint.mark()
    patch(checkpoint, "a", [0, 2], 5.0)
    checkpoint.stage_whole("b", torch.ones(16))
    checkpoint.revert_to(mark)
    assert same(snapshot(checkpoint), after_first)
    assert "b" not in {n for n, t in checkpoint.pending().items() if torch.equal(t, torch.ones(16))}


def test_release_forgets_the_previous_weights() -> None:
    checkpoint = ServingCheckpoint(weights)
    patch(checkpoint, "a", [0], 4.0)
    checkpoint.commit()
    checkpoint.recycle_commit()
    try:
        checkpoint.revert_commit()
    except RuntimeError as error:
        assert "nothing to roll back" in str(error)
    else:
        raise AssertionError("a released commit was rolled back")


def test_full_updates_reuse_the_two_copies_they_need() -> None:
    checkpoint = ServingCheckpoint(weights)
    first = checkpoint.tensors["b"]

    def full_update(value: float) -> torch.Tensor:
        buffer: torch.Tensor = checkpoint.buffer_for("b", [16], torch.float32)
        buffer.fill_(value)
        checkpoint.stage_whole("b", buffer)
        checkpoint.commit()
        return buffer

    checkpoint.recycle_commit()  # no commit yet: nothing to reuse
    second = full_update(1.0)  # a new tensor: the first is kept for a rollback
    assert second.data_ptr() != first.data_ptr()
    checkpoint.recycle_commit()
    third = full_update(2.0)  # into the first's memory, released by the rollback
    assert third.data_ptr() == first.data_ptr()
    assert torch.equal(checkpoint.tensors["b"], torch.full((16,), 2.0))
    assert checkpoint.revert_commit() == 1  # the rollback still restores the value before
    assert torch.equal(checkpoint.tensors["b"], torch.ones(16))
    # A cancelled update's buffer is reused too; a shape that differs gets a new one.
    staged = checkpoint.buffer_for("b", [16], torch.float32)
    checkpoint.stage_whole("b", staged)
    checkpoint.discard()
    assert checkpoint.buffer_for("b", [16], torch.float32).data_ptr() == staged.data_ptr()
    assert checkpoint.buffer_for("b", [4, 4], torch.float32).data_ptr() != staged.data_ptr()


def test_xor_values_give_the_new_bits_and_a_cancel_restores_them() -> None:
    checkpoint = ServingCheckpoint(weights)
    before = snapshot(checkpoint)
    indices = torch.tensor([1, 6, 30])
    old = flat_bits(before["a"])[indices]
    new = flat_bits(torch.tensor([0.5, -2.0, 3.0], dtype=torch.bfloat16))
    checkpoint.patch("a", named([1, 6, 30]), False, (old ^ new).numpy(), xor=True)
    assert torch.equal(flat_bits(checkpoint.tensors["a"])[indices], new)
    checkpoint.discard()
    assert same(snapshot(checkpoint), before)
    # On a tensor staged whole in the same update: XORs with the staged value.
    staged = torch.zeros(4, 8, dtype=torch.bfloat16)
    checkpoint.stage_whole("a", staged)
    # XOR with zero bits: the bits themselves.
    checkpoint.patch("a", named([1, 6, 30]), False, new.numpy(), xor=True)
    assert torch.equal(flat_bits(checkpoint.pending()["a"])[indices], new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_a_bitmap_patch_writes_the_elements_it_names_and_a_cancel_restores_them(
    dtype: torch.dtype,
) -> None:
    elements = 1000
    tensors = {"w": torch.randn(elements, generator=torch.Generator().manual_seed(5)).to(dtype)}
    checkpoint = ServingCheckpoint(lambda: {n: t.clone() for n, t in tensors.items()})
    before = snapshot(checkpoint)
    chosen = np.sort(np.random.default_rng(0).choice(elements, 300, replace=False))
    chosen[-1] = elements - 1  # the last element too: the bitmap's last byte, part used
    values = flat_bits(torch.linspace(-4, 4, len(chosen)).to(dtype)).numpy()
    bitmap = patch_format.bitmap_of(chosen, elements)
    _, indices = checkpoint.patch("w", bitmap, True, values)
    assert indices.tolist() == chosen.tolist()
    expected = flat_bits(before["w"]).clone()
    expected[torch.from_numpy(chosen)] = torch.from_numpy(values)
    assert torch.equal(flat_bits(checkpoint.tensors["w"]), expected)
    checkpoint.discard()
    assert same(snapshot(checkpoint), before)


def test_a_patch_that_does_not_fit_its_parameter_is_refused_with_nothing_written() -> None:
    checkpoint = ServingCheckpoint(weights)
    before = snapshot(checkpoint)
    new = flat_bits(torch.ones(3, dtype=torch.bfloat16)).numpy()
    with pytest.raises(ValueError, match="past the tensor's 32"):  # "a" has 32 elements
        checkpoint.patch("a", named([0, 5, 32]), False, new)
    bitmap = patch_format.bitmap_of(np.array([1, 2, 3, 4]), 32)  # four named, three values
    with pytest.raises(ValueError, match="not exactly as many as its 3 values"):
        checkpoint.patch("a", bitmap, True, new)
    assert same(snapshot(checkpoint), before) and checkpoint.staged_count == 0


def test_freeing_a_commit_drops_what_a_rollback_would_restore() -> None:
    checkpoint = ServingCheckpoint(weights)
    first = checkpoint.tensors["b"]
    buffer = checkpoint.buffer_for("b", [16], torch.float32)
    buffer.fill_(1.0)
    checkpoint.stage_whole("b", buffer)
    checkpoint.patch("a", named([0, 3]), False, np.array([7, 7], dtype=np.int16))
    checkpoint.commit()
    # The replaced "b" (16 float32) and the 2 bfloat16 elements the patch overwrote.
    assert checkpoint.free_commit() == 16 * 4 + 2 * 2
    assert not checkpoint.can_revert_commit and checkpoint.committed_names() == set()
    assert checkpoint.free_commit() == 0
    # The next update's whole value goes to new memory: the old tensor was not kept as a spare.
    checkpoint.recycle_commit()
    assert checkpoint.buffer_for("b", [16], torch.float32).data_ptr() != first.data_ptr()
    assert torch.equal(checkpoint.tensors["b"], torch.ones(16))


def test_spares_made_at_start_take_the_first_full_update() -> None:
    checkpoint = ServingCheckpoint(weights)
    assert checkpoint.prepare_spares() == 4 * 8 * 2 + 16 * 4  # one of each parameter
    assert checkpoint.prepare_spares() == 0  # each has one already
    prepared = {
        name: checkpoint.buffer_for(name, list(t.shape), t.dtype) for name, t in weights().items()
    }
    # Every one fits its parameter and is a tensor of its own, not the serving one.
    assert {n: t.data_ptr() for n, t in prepared.items()}.keys() == {"a", "b"}
    assert all(t.data_ptr() != checkpoint.tensors[n].data_ptr() for n, t in prepared.items())
    assert checkpoint.buffer_for("b", [16], torch.float32).data_ptr() not in {
        t.data_ptr() for t in prepared.values()
    }  # taken: the next one is new


def in_shared_memory() -> tuple[ServingCheckpoint, SharedCopy]:
    plain = weights()
    shared = SharedCopy(layout_of(plain))
    tensors = {name: shared.value(name, 0).copy_(tensor) for name, tensor in plain.items()}
    return ServingCheckpoint(lambda: tensors, shared), shared


def test_in_shared_memory_full_updates_alternate_two_places_and_roll_back_exactly() -> None:
    checkpoint, shared = in_shared_memory()
    places = {name: shared.offset_of(t) for name, t in checkpoint.tensors.items()}
    assert None not in places.values()
    checkpoint.prepare_spares()
    committed = []
    for step in range(3):  # each update's values go to the place the serving ones are not in
        before = snapshot(checkpoint)
        for name, tensor in before.items():
            buffer = checkpoint.buffer_for(name, list(tensor.shape), tensor.dtype)
            assert shared.offset_of(buffer) not in (
                None,
                shared.offset_of(checkpoint.tensors[name]),
            )
            buffer.copy_(tensor + step + 1)
            checkpoint.stage_whole(name, buffer)
        checkpoint.commit()
        committed.append(snapshot(checkpoint))
        if step < 2:
            checkpoint.recycle_commit()
    assert {name: shared.offset_of(t) for name, t in checkpoint.tensors.items()} != places
    # The last commit kept what it replaced in the other place: the rollback reads it there.
    assert checkpoint.revert_commit() == 2
    assert same(snapshot(checkpoint), committed[1])
    assert not same(committed[1], committed[2])


def test_in_shared_memory_a_release_gives_the_replaced_values_pages_back() -> None:
    checkpoint, shared = in_shared_memory()
    checkpoint.prepare_spares()
    held = shared.allocated_bytes()
    for name, tensor in snapshot(checkpoint).items():
        buffer = checkpoint.buffer_for(name, list(tensor.shape), tensor.dtype)
        checkpoint.stage_whole(name, buffer.copy_(tensor * 2))
    checkpoint.commit()
    assert checkpoint.free_commit() == 4 * 8 * 2 + 16 * 4
    assert shared.allocated_bytes() < held  # a page each, given back
    # The next update takes the place again (fresh pages), and serves what it was sent.
    buffer = checkpoint.buffer_for("b", [16], torch.float32)
    assert shared.offset_of(buffer) is not None
    checkpoint.stage_whole("b", buffer.copy_(torch.arange(16.0)))
    checkpoint.commit()
    assert torch.equal(checkpoint.tensors["b"], torch.arange(16.0))


def test_the_other_ranks_read_the_copy_where_it_lies() -> None:
    checkpoint, shared = in_shared_memory()
    reader = SharedCopyReader()  # as another process of the host would open it
    assert reader.why_unreadable(shared.path) == ""
    assert reader.why_unreadable("/proc/self/fd/999999").startswith("FileNotFoundError")
    patch(checkpoint, "a", [2], 5.0)  # written in place: the readers see it
    for tensor in checkpoint.tensors.values():
        offset = shared.offset_of(tensor)
        assert offset is not None
        seen = reader.tensor(shared.path, offset, tensor.dtype, list(tensor.shape))
        assert torch.equal(flat_bits(seen), flat_bits(tensor))
    assert checkpoint.tensors["a"].view(-1)[2].item() == 5.0


def test_without_shared_memory_the_copy_is_plain_and_updates_still_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "memfd_create", refuse)
    tensors, shared = copied(weights())
    assert shared is None and same(tensors, weights())
    checkpoint = ServingCheckpoint(lambda: tensors, shared)
    assert checkpoint.location(tensors["a"]) is None  # the other ranks get it sent
    checkpoint.prepare_spares()
    buffer = checkpoint.buffer_for("b", [16], torch.float32)
    checkpoint.stage_whole("b", buffer.copy_(torch.ones(16)))
    checkpoint.commit()
    assert torch.equal(checkpoint.tensors["b"], torch.ones(16))
