"""Whether raw tensor bytes hold NaN or infinity, checked as they arrive.

Weights with a NaN or infinity poison every generation (the tiny model's greedy output became
all token 0) and, through the KV cache, requests that follow. A push is refused if any value is
not finite, unless the server was told to allow them. Numpy checks float32/64 and float16 at
memory speed (``isfinite`` over 4 MiB takes ~0.2 ms here, a quarter of the chunk's CRC-32);
bfloat16 and the 8-bit floats, which numpy has no type for, are checked through their bits: a
value is not finite when its exponent field is all ones (e4m3fn has no infinity, only NaN,
written as all ones but the sign).
"""

from __future__ import annotations

import numpy as np

# Floating types numpy reads natively.
_NATIVE = {"float32": np.float32, "float64": np.float64, "float16": np.float16}
# Others: (unsigned type of the same width, the bits that are all ones for NaN / infinity).
_BY_BITS = {
    "bfloat16": (np.uint16, 0x7F80),
    "float8_e5m2": (np.uint8, 0x7C),
    "float8_e4m3fn": (np.uint8, 0x7F),
}
FLOATING = frozenset(_NATIVE) | frozenset(_BY_BITS)


def all_finite(data: bytes | bytearray | memoryview, dtype: str) -> bool:
    """True if every value in ``data`` (whole elements of ``dtype``, a torch dtype name) is
    finite; always True for integer and boolean types."""
    native = _NATIVE.get(dtype)
    if native is not None:
        return bool(np.isfinite(np.frombuffer(data, dtype=native)).all())
    by_bits = _BY_BITS.get(dtype)
    if by_bits is None:
        return True
    unsigned, mask = by_bits
    bits = np.frombuffer(data, dtype=unsigned)
    return not bool(((bits & mask) == mask).any())


class FiniteCheck:
    """Checks one parameter's bytes chunk by chunk, whatever the chunk boundaries: an element
    cut by a boundary is checked once its bytes are together."""

    def __init__(self, dtype: str, itemsize: int) -> None:
        self._dtype = dtype
        self._itemsize = itemsize
        self._carry = b""
        self.finite = True

    def add(self, chunk: bytes | memoryview) -> bool:
        """Checks the next chunk; returns False (and stays False) once a value is not finite."""
        if not self.finite or self._dtype not in FLOATING:
            return self.finite
        view = memoryview(chunk).cast("B")
        start = 0
        if self._carry:
            start = min(self._itemsize - len(self._carry), len(view))
            self._carry += bytes(view[:start])
            if len(self._carry) < self._itemsize:
                return True
            self.finite = all_finite(self._carry, self._dtype)
            self._carry = b""
        end = start + (len(view) - start) // self._itemsize * self._itemsize
        if end > start:
            self.finite = self.finite and all_finite(view[start:end], self._dtype)
        self._carry = bytes(view[end:])
        return self.finite
