"""``finite.all_finite`` against torch, over every bit pattern of each 8- and 16-bit float type
(the types numpy cannot read natively are checked through their bits), and float32 at the
edges; and ``FiniteCheck`` across chunk boundaries that cut elements."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from servers.engine.transfer.finite import FiniteCheck, all_finite


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e5m2", "float8_e4m3fn"])
def test_every_bit_pattern_is_judged_as_torch_judges_it(dtype: str) -> None:
    torch_type = getattr(torch, dtype)
    width = torch_type.itemsize * 8
    bits = torch.arange(1 << width, dtype=torch.int32).to(
        torch.int16 if width == 16 else torch.uint8
    )
    values = bits.view(torch_type)
    finite = torch.isfinite(values.float())
    raw = bits.numpy().tobytes()
    itemsize = torch_type.itemsize
    verdicts = [
        all_finite(raw[i * itemsize : (i + 1) * itemsize], dtype) for i in range(1 << width)
    ]
    assert verdicts == finite.tolist()
    assert all_finite(raw, dtype) is False  # the whole range holds NaNs
    assert all_finite(values[finite].view(bits.dtype).numpy().tobytes(), dtype) is True
    assert all_finite(b"", dtype) is True


def test_float32_edges() -> None:
    edge = np.array([0.0, -0.0, 3.4e38, -3.4e38, 1e-45], dtype=np.float32)
    assert all_finite(edge.tobytes(), "float32")
    for bad in (np.inf, -np.inf, np.nan):
        assert not all_finite(np.append(edge, np.float32(bad)).tobytes(), "float32")


def test_an_element_cut_by_a_chunk_boundary_is_checked_once_whole() -> None:
    values = torch.tensor([1.0, 2.0, float("nan"), 4.0], dtype=torch.bfloat16)
    raw = values.view(torch.int16).numpy().tobytes()
    check = FiniteCheck("bfloat16", 2)
    assert check.add(raw[:5])  # the NaN's first byte only
    assert not check.add(raw[5:])
    assert not check.add(b"\x00\x00")  # and it stays so
