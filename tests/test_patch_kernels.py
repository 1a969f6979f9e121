"""The compiled loops that apply a weight patch (``patch_kernels``): the same bits as numpy's
scatter, and no compilation left for an update once the server prepared them."""

from __future__ import annotations

import numpy as np

from servers.engine.weights import patch_kernels
from skyrl_grpc import patch_format


def test_patches_as_received_use_the_loops_compiled_at_start_and_write_what_numpy_would() -> None:
    patch_kernels.prepare({np.dtype(np.int16)})
    loops = patch_kernels._by_bitmap, patch_kernels._by_indices
    compiled = [len(patch_kernels.compiled(loop).signatures) for loop in loops]
    rng = np.random.default_rng(1)
    elements = 4099  # a bitmap whose last byte is part used
    base = rng.integers(-(1 << 15), 1 << 15, elements, dtype=np.int16)
    for bitmap, share in ((True, 0.3), (False, 0.01)):
        chosen = np.flatnonzero(rng.random(elements) < share)
        names = patch_format.bitmap_of(chosen, elements) if bitmap else chosen.astype("<u4")
        values = rng.integers(-(1 << 15), 1 << 15, chosen.size, dtype=np.int16)
        # As a server receives a patch: read-only bytes, the values at an odd offset.
        wire = b"\0" + names.tobytes() + values.tobytes()
        raw = np.frombuffer(wire, dtype=np.uint8)[1:]
        start = patch_format.names_bytes(elements, chosen.size, bitmap)
        flat = base.copy()
        indices, old = patch_kernels.apply_in_place(
            flat, raw[:start], bitmap, raw[start:].view(np.int16)
        )
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
