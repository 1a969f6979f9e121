"""The in-band chunk's hand-written wire format agrees with protobuf, both ways."""

from __future__ import annotations

import random
import zlib

import pytest
from google.protobuf.message import DecodeError

from skyrl_grpc.chunk_wire import WireChunk, decode_push_request, encode_chunk
from skyrl_grpc.v1 import control_plane_pb2 as cp


def parse(raw: bytes) -> cp.PushWeightsRequest:
    """What protobuf reads, without the unknown fields the servers never look at."""
    message = cp.PushWeightsRequest.FromString(raw)
    message.DiscardUnknownFields()
    return message


def as_proto(item: cp.PushWeightsRequest | WireChunk) -> cp.PushWeightsRequest:
    if isinstance(item, cp.PushWeightsRequest):
        item.DiscardUnknownFields()
        return item
    chunk = cp.WeightChunk(
        name=item.name, offset_bytes=item.offset_bytes, data=bytes(item.data), sha256=item.sha256
    )
    if item.crc32 is not None:
        chunk.crc32 = item.crc32
    return cp.PushWeightsRequest(chunk=chunk)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 20_000, 3_000_000])
def test_an_encoded_chunk_is_the_message_protobuf_would_build(size: int) -> None:
    data = bytes(i % 251 for i in range(size))
    wire = encode_chunk("layers.0.mlp.weight", 4 << 20, memoryview(data))
    expected = cp.PushWeightsRequest(
        chunk=cp.WeightChunk(
            name="layers.0.mlp.weight", offset_bytes=4 << 20, data=data, crc32=zlib.crc32(data)
        )
    )
    assert cp.PushWeightsRequest.FromString(wire) == expected
    decoded = decode_push_request(wire)
    assert isinstance(decoded, WireChunk)
    assert as_proto(decoded) == expected


def test_a_chunks_data_is_read_without_a_copy() -> None:
    wire = encode_chunk("w", 0, memoryview(b"x" * 1000))
    decoded = decode_push_request(wire)
    assert isinstance(decoded, WireChunk) and isinstance(decoded.data, memoryview)
    assert decoded.data.obj is wire


def wrap(inner: bytes) -> bytes:
    """``inner`` as the chunk field of a PushWeightsRequest (inner is under 128 bytes)."""
    return bytes([2 << 3 | 2, len(inner)]) + inner


UNUSUAL = {
    "manifest": cp.PushWeightsRequest(
        manifest=cp.WeightManifest(parameters=[cp.ParameterSpec(name="w", shape=[2])])
    ).SerializeToString(),
    "sha256 instead of crc32": cp.PushWeightsRequest(
        chunk=cp.WeightChunk(name="w", data=b"ab", sha256=b"s" * 32)
    ).SerializeToString(),
    "no checksum": cp.PushWeightsRequest(chunk=cp.WeightChunk(name="w")).SerializeToString(),
    "empty": b"",
    # Two chunk fields: protobuf merges them (the later data wins).
    "chunk twice": encode_chunk("w", 0, memoryview(b"first"))
    + cp.PushWeightsRequest(chunk=cp.WeightChunk(data=b"second")).SerializeToString(),
    # An unknown field inside the chunk (from a newer sender): protobuf keeps it aside.
    "unknown field": wrap(
        cp.WeightChunk(name="w", offset_bytes=8, data=b"data", crc32=1).SerializeToString()
        + bytes([15 << 3 | 0, 1])
    ),
    # A field given twice inside the chunk: the last one wins.
    "name twice": wrap(
        cp.WeightChunk(name="a", crc32=1).SerializeToString()
        + cp.WeightChunk(name="b", data=b"x").SerializeToString()
    ),
}


@pytest.mark.parametrize("name", sorted(UNUSUAL))
def test_unusual_messages_mean_what_protobuf_says(name: str) -> None:
    raw = UNUSUAL[name]
    assert as_proto(decode_push_request(raw)) == parse(raw)


def test_random_bytes_decode_as_protobuf_decodes_them_or_fail_as_it_does() -> None:
    rng = random.Random(7)
    valid = encode_chunk("layer.weight", 1 << 40, memoryview(bytes(range(200))))
    for _ in range(3000):
        flipped = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        cut = rng.random() < 0.3
        raw = bytes(flipped[: rng.randint(0, len(flipped))] if cut else flipped)
        try:
            expected = parse(raw)
        except DecodeError:
            with pytest.raises(DecodeError):
                decode_push_request(raw)
            continue
        assert as_proto(decode_push_request(raw)) == expected
