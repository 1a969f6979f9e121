"""How a sparse weight patch lies on the wire (``control_plane.proto``'s WeightPatch).

A patch first names the parameter's changed elements, then carries their new values (the
parameter's element type, in element order). It names them one of two ways, whichever is
smaller: little-endian uint32 indices, strictly increasing (4 bytes per changed element), or,
with ``WeightPatch.bitmap``, one bit per element of the parameter, least significant bit first,
the bits past the last element zero. The bitmap is the smaller once more than one element in 32
changed: an RL step at lr 1e-5 changes 12-25% of bf16 values, where indices would make a patch
3x the size of its values. A patch may also travel zstd-compressed (below).

numpy and zstandard: the trainer writes patches with it, the server checks and applies them.
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


def named_count(bits: Any) -> int:
    """How many elements a bitmap, or a run of its bytes (a uint8 array), names: its set bits."""
    import numpy as np

    return int(np.frombuffer(_POPCOUNT, dtype=np.uint8)[bits].sum(dtype=np.int64))


def bitmap_problem(bitmap: Any, elements: int, changed: int) -> str:
    """Why ``bitmap`` (bitmap_bytes(elements) bytes) does not name ``changed`` elements of a
    parameter of ``elements``: "" when it does."""
    import numpy as np

    bits = np.frombuffer(bitmap, dtype=np.uint8, count=bitmap_bytes(elements))
    named = named_count(bits)
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


# -- compressed patches ----------------------------------------------------------------------
#
# With ``WeightPatch.zstd_bytes`` a patch travels as one zstd frame of that many bytes. The frame
# holds the patch as above with two changes that make it compress: indices are gaps (the first
# index, then each one's distance from the one before: small numbers), and each value is the
# XOR of the new value's bits with the value the base version holds there (an optimizer step
# moves the low mantissa bits; sign, exponent and high mantissa stay, so most XOR bytes are 0).
# Both are byte planes: every element's lowest byte, then every element's next one, and so on.
# A bitmap goes as it is. Decompressed, the frame must be exactly ``patch_bytes`` long. An RL
# step at lr 1e-6 (bf16) compresses to ~0.2 of its patch, at lr 1e-5 to ~0.35: sent once and
# received by every server, it pays where the link, not the CPU, is the limit.

# zstd's fastest level: higher levels gained 0-5% at 2-3x the time on weight patches.
ZSTD_LEVEL = 1


def compress(
    payload: Any, base_values: Any, elements: int, itemsize: int, changed: int, bitmap: bool
) -> bytes:
    """The zstd frame of a patch. ``payload``: the patch's bytes (uint8 array, laid out as
    above); ``base_values``: the base version's values at the changed elements, as unsigned
    integers of ``itemsize`` bytes."""
    import numpy as np
    import zstandard

    start = names_bytes(elements, changed, bitmap)
    frame = np.empty(start + changed * itemsize, dtype=np.uint8)
    if bitmap:
        frame[:start] = payload[:start]
    else:
        indices = payload[:start].view("<u4")
        gaps = np.empty_like(indices)
        gaps[0] = indices[0]
        np.subtract(indices[1:], indices[:-1], out=gaps[1:])
        frame[:start].reshape(INDEX_BYTES, -1)[:] = gaps.view(np.uint8).reshape(-1, INDEX_BYTES).T
    xor = np.bitwise_xor(payload[start:].view(base_values.dtype), base_values)
    frame[start:].reshape(itemsize, -1)[:] = xor.view(np.uint8).reshape(-1, itemsize).T
    return bytes(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(frame.data))


def decompress(frame: Any, elements: int, itemsize: int, changed: int, bitmap: bool) -> Any:
    """The patch a zstd frame holds, laid out as an uncompressed one except that its values are
    XORs with the base version's (uint8 array); ValueError saying what is wrong with it."""
    import numpy as np
    import zstandard

    size = patch_bytes(elements, itemsize, changed, bitmap)
    try:
        # max_output_size bounds what a frame without its size in the header may expand to.
        data = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as error:
        raise ValueError(f"its zstd frame does not decompress ({error})") from None
    if len(data) != size:
        raise ValueError(f"its zstd frame holds {len(data)} bytes; the patch has {size}")
    raw = np.frombuffer(data, dtype=np.uint8)
    start = names_bytes(elements, changed, bitmap)
    patch = np.empty(size, dtype=np.uint8)
    if bitmap:
        patch[:start] = raw[:start]
    else:
        gaps = np.empty(changed, dtype="<u4")
        gaps.view(np.uint8).reshape(-1, INDEX_BYTES)[:] = raw[:start].reshape(INDEX_BYTES, -1).T
        # Wrapping sums of uint32 gaps: anything past 2**32 shows up as indices out of order.
        np.cumsum(gaps, dtype=np.uint32, out=patch[:start].view("<u4"))
    patch[start:].reshape(-1, itemsize)[:] = raw[start:].reshape(itemsize, -1).T
    return patch
