"""CRC-32 of in-band weight and adapter chunks, as fast as the CPU computes it.

The checksum is zlib's (IEEE 802.3, what ``WeightChunk.crc32`` names); ``zlib.crc32`` runs at
2-4 GB/s here, which made checksumming a model's chunks cost more than moving them over
loopback. ISA-L's implementation (``isal``, carry-less multiply instructions) computes the same
value at ~24 GB/s on this machine, from a view of the tensor's memory (no copy). ``zlib`` is the
fallback where no ``isal`` wheel exists.
"""

from __future__ import annotations

from typing import Any

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - platforms without an isal wheel
    from zlib import crc32 as _crc32


def crc32(data: Any) -> int:
    """zlib's CRC-32 of ``data`` (bytes, or any contiguous buffer: a memoryview of a tensor)."""
    return int(_crc32(data))
