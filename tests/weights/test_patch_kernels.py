"""The compiled loops that apply a weight patch (``patch_kernels``): the same bits as numpy's
scatter, whole or in pieces on several threads, nothing left written by a patch that does not
fit, and no compilation left for an update once the server prepared them."""

from __future__ import annotations

import numpy as np
import pytest

from servers.engine.worker import patch_kernels
from skyrl_grpc import patch_format


@pytest.fixture(params=["whole", "in pieces"])
def pieces(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Patches applied in one piece (small ones, as here), or split into four on threads."""
    if request.param == "in pieces":
        monkeypatch.setattr(patch_kernels, "PIECE_ELEMENTS", 256)
        monkeypatch.setattr(patch_kernels, "_thread_count", lambda: 4)
    return str(request.param)


def received(names: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A patch's names and values as a server receives them: read-only bytes, the values at an
    odd offset."""
    wire = b"\0" + names.tobytes() + values.tobytes()
    raw = np.frombuffer(wire, dtype=np.uint8)[1:]
    return raw[: names.nbytes], raw[names.nbytes :].view(values.dtype)


def test_patches_as_received_use_the_loops_compiled_at_start_and_write_what_numpy_would(
    pieces: str,
) -> None:
    patch_kernels.prepare({2, 16})  # bf16's integers; 16-byte elements are never patched
    loops = patch_kernels._by_bitmap, patch_kernels._by_indices
    compiled = [len(patch_kernels.compiled(loop).signatures) for loop in loops]
    rng = np.random.default_rng(1)
    elements = 4099  # a bitmap whose last byte is part used
    base = rng.integers(-(1 << 15), 1 << 15, elements, dtype=np.int16)
    for bitmap, share in ((True, 0.3), (False, 0.3)):
        chosen = np.flatnonzero(rng.random(elements) < share)
        chosen[-1] = elements - 1
        names = patch_format.bitmap_of(chosen, elements) if bitmap else chosen.astype("<u4")
        spans = (
            patch_kernels._spans(names.size, 8) if bitmap else patch_kernels._spans(chosen.size, 1)
        )
        assert len(spans) == (4 if pieces == "in pieces" else 1)
        values = rng.integers(-(1 << 15), 1 << 15, chosen.size, dtype=np.int16)
        flat = base.copy()
        names_received, values_received = received(names, values)
        indices, old = patch_kernels.apply_in_place(flat, names_received, bitmap, values_received)
        expected = base.copy()
        expected[chosen] = values
        assert np.array_equal(flat, expected)
        assert indices.tolist() == chosen.tolist() and np.array_equal(old, base[chosen])
        xored = base.copy()  # a compressed patch's values: XORs with the bits there
        patch_kernels.apply_in_place(
            xored, names.view(np.uint8), bitmap, values ^ base[chosen], True
        )
        assert np.array_equal(xored, expected)
    assert [len(patch_kernels.compiled(loop).signatures) for loop in loops] == compiled


def test_a_patch_that_does_not_fit_leaves_every_element_as_it_was(pieces: str) -> None:
    elements = 2048
    base = np.arange(elements, dtype=np.int32)
    # Indices: the last one past the end, after others (in other pieces) were written.
    named = np.append(np.arange(0, elements, 4), elements).astype("<u4")
    flat = base.copy()
    with pytest.raises(ValueError, match="past the tensor's 2048"):
        patch_kernels.apply_in_place(
            flat, named.view(np.uint8), False, -np.ones(named.size, np.int32)
        )
    assert np.array_equal(flat, base)
    # A bitmap naming one element more than there are values.
    bitmap = patch_format.bitmap_of(np.arange(0, elements, 2), elements)
    with pytest.raises(ValueError, match="not exactly as many as its 1023 values"):
        patch_kernels.apply_in_place(flat, bitmap, True, -np.ones(1023, np.int32))
    assert np.array_equal(flat, base)
