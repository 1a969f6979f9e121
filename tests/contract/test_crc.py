"""The chunk checksum is zlib's CRC-32 whichever implementation computes it (``skyrl_grpc.crc``):
a sender on ISA-L and a receiver on zlib (or the reverse) must agree."""

from __future__ import annotations

import zlib

import torch

from skyrl_grpc.crc import crc32


def test_the_fast_crc_is_zlibs_on_bytes_and_on_tensor_memory() -> None:
    tensor = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    view = tensor.numpy().data.cast("B")
    assert crc32(view) == zlib.crc32(view)
    assert crc32(view[3:1001]) == zlib.crc32(bytes(view[3:1001]))  # an unaligned slice
    assert crc32(b"") == zlib.crc32(b"") == 0
