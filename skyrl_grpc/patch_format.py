"""How a sparse weight patch lies on the wire (``control_plane.proto``'s WeightPatch).

A patch first names the parameter's changed elements, then carries their new values (the
parameter's element type, in element order). It names them one of two ways, whichever is
smaller: little-endian uint32 indices, strictly increasing (4 bytes per changed element), or,
with ``WeightPatch.bitmap``, one bit per element of the parameter, least significant bit first,
the bits past the last element zero. The bitmap is the smaller once more than one element in 32
changed: an RL step at lr 1e-5 changes 12-25% of bf16 values, where indices would make a patch
3x the size of its values.

Plain numpy: the trainer writes patches with it, the server checks and applies them.
"""

from __future__ import annotations

from typing import Any

# Bytes of one index in an index-named patch.
INDEX_BYTES = 4


def bitmap_bytes(elements: int) -> int:
    """Bytes of the bitmap of a parameter of ``elements`` elements."""
    return (elements + 7) // 8


def prefers_bitmap(elements: int, changed: int) -> bool:
    """Whether a bitmap names ``changed`` of ``elements`` elements in fewer bytes than indices."""
    return bitmap_bytes(elements) < changed * INDEX_BYTES


def names_bytes(elements: int, changed: int, bitmap: bool) -> int:
    """Bytes naming the changed elements: where the values start."""
    return bitmap_bytes(elements) if bitmap else changed * INDEX_BYTES


def patch_bytes(elements: int, itemsize: int, changed: int, bitmap: bool) -> int:
    """Bytes of a whole patch: the names, then ``changed`` values of ``itemsize`` bytes."""
    return names_bytes(elements, changed, bitmap) + changed * itemsize


def bitmap_of(indices: Any, elements: int) -> Any:
    """The bitmap (uint8 array) naming ``indices`` (increasing) of ``elements`` elements."""
    import numpy as np

    mask = np.zeros(elements, dtype=bool)
    mask[indices] = True
    return np.packbits(mask, bitorder="little")


# Set bits in each byte value.
_POPCOUNT = bytes(bin(value).count("1") for value in range(256))


def bitmap_problem(bitmap: Any, elements: int, changed: int) -> str:
    """Why ``bitmap`` (bitmap_bytes(elements) bytes) does not name ``changed`` elements of a
    parameter of ``elements``: "" when it does."""
    import numpy as np

    bits = np.frombuffer(bitmap, dtype=np.uint8, count=bitmap_bytes(elements))
    named = int(np.frombuffer(_POPCOUNT, dtype=np.uint8)[bits].sum(dtype=np.int64))
    if named != changed:
        return f"its bitmap names {named} elements, the manifest says {changed}"
    spare = bitmap_bytes(elements) * 8 - elements
    if spare and int(bits[-1]) >> (8 - spare):
        return f"its bitmap names elements past the last of {elements}"
    return ""


def changed_indices(names: Any, elements: int, changed: int, bitmap: bool) -> Any:
    """The changed elements' indices (an increasing numpy array: int32 where every index fits,
    else int64) from a patch's names (anything holding their bytes)."""
    import numpy as np

    index_type = np.int32 if elements < 1 << 31 else np.int64
    if bitmap:
        bits = np.frombuffer(names, dtype=np.uint8, count=bitmap_bytes(elements))
        # As bools: numpy finds the set elements of a bool array ~7x faster than of uint8.
        mask = np.unpackbits(bits, count=elements, bitorder="little").view(bool)
        return np.flatnonzero(mask).astype(index_type)
    return np.frombuffer(names, dtype="<u4", count=changed).astype(index_type)
