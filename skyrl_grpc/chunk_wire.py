"""The in-band weight chunk on the wire, written and read without copying its data.

A ``PushWeightsRequest`` carrying a chunk is almost all data. Going through protobuf copies the
data three times on the sender (to bytes, into the message, out to the wire) and twice on the
receiver (parsing, then reading the ``data`` field), and at a few GB/s those copies cost more
than the transport. So the sender serializes the small fields with protobuf and appends the
data field in wire format straight from the tensor's memory (fields may come in any order), and
the receiver reads the fields by hand and keeps the data as a view of the received message.

Anything the fast reader does not expect (a manifest, unknown fields, a wire type it does not
use) goes to protobuf's own parser instead, so the contract stays the protobuf definition.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_grpc.crc import crc32 as crc_of
from skyrl_grpc.v1 import control_plane_pb2 as cp

_CHUNK = cp.PushWeightsRequest.DESCRIPTOR.fields_by_name["chunk"].number
_NAME = cp.WeightChunk.DESCRIPTOR.fields_by_name["name"].number
_OFFSET = cp.WeightChunk.DESCRIPTOR.fields_by_name["offset_bytes"].number
_DATA = cp.WeightChunk.DESCRIPTOR.fields_by_name["data"].number
_SHA256 = cp.WeightChunk.DESCRIPTOR.fields_by_name["sha256"].number
_CRC32 = cp.WeightChunk.DESCRIPTOR.fields_by_name["crc32"].number
_VARINT, _LENGTH_DELIMITED = 0, 2


@dataclass(frozen=True, slots=True)
class WireChunk:
    """A ``WeightChunk`` whose ``data`` may be a view into the received message."""

    name: str
    offset_bytes: int
    data: bytes | memoryview
    crc32: int | None
    sha256: bytes

    @classmethod
    def from_proto(cls, chunk: cp.WeightChunk) -> WireChunk:
        return cls(
            chunk.name,
            chunk.offset_bytes,
            chunk.data,
            chunk.crc32 if chunk.HasField("crc32") else None,
            chunk.sha256,
        )


def encode_chunk(name: str, offset: int, piece: memoryview, crc32: int | None = None) -> bytes:
    """A serialized ``PushWeightsRequest`` carrying one chunk with its CRC-32 (``crc32`` when
    the caller computed it already); ``piece`` is copied once, into the result."""
    crc = crc_of(piece) if crc32 is None else crc32
    return b"".join((chunk_head(name, offset, len(piece), crc), piece))


def chunk_head(name: str, offset: int, size: int, crc32: int) -> bytes:
    """Every byte of ``encode_chunk``'s message before the chunk's ``size`` bytes of data: a
    sender that writes the data from its own memory right after it (a socket's scatter
    write) sends the same message without copying the data."""
    head_bytes = cp.WeightChunk(name=name, offset_bytes=offset, crc32=crc32).SerializeToString()
    data_prefix = _varint(_DATA << 3 | _LENGTH_DELIMITED) + _varint(size)
    inner = len(head_bytes) + len(data_prefix) + size
    return b"".join(
        (_varint(_CHUNK << 3 | _LENGTH_DELIMITED), _varint(inner), head_bytes, data_prefix)
    )


def decode_push_request(raw: bytes | memoryview) -> cp.PushWeightsRequest | WireChunk:
    """The request as a ``WireChunk`` (data not copied: a view of ``raw``) when it is a plain
    chunk, else as protobuf parses it. Raises ``DecodeError`` for bytes protobuf would
    reject."""
    try:
        chunk = _read_chunk(raw)
    except _Unusual:
        chunk = None
    if chunk is not None:
        return chunk
    message = cp.PushWeightsRequest.FromString(bytes(raw))
    if message.WhichOneof("item") == "chunk":
        return WireChunk.from_proto(message.chunk)
    return message


class _Unusual(Exception):
    """Something the fast reader leaves to protobuf."""


def _read_chunk(raw: bytes | memoryview) -> WireChunk | None:
    view = memoryview(raw)
    tag, position = _read_varint(raw, 0)
    if tag != (_CHUNK << 3 | _LENGTH_DELIMITED):
        return None  # a manifest, or not a single chunk field
    length, start = _read_varint(raw, position)
    end = start + length
    if end != len(raw):
        raise _Unusual  # more top-level fields follow (protobuf merges them)
    name, offset, sha256, crc32 = "", 0, b"", None
    data: bytes | memoryview = b""
    position = start
    while position < end:
        tag, position = _read_varint(raw, position)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT and field in (_OFFSET, _CRC32):
            value, position = _read_varint(raw, position)
            if field == _OFFSET:
                offset = value
            else:
                crc32 = value & 0xFFFFFFFF
                if value != crc32:
                    raise _Unusual
            continue
        if wire_type != _LENGTH_DELIMITED or field not in (_NAME, _DATA, _SHA256):
            raise _Unusual
        length, position = _read_varint(raw, position)
        if position + length > end:
            raise _Unusual
        value_view = view[position : position + length]
        position += length
        if field == _DATA:
            data = value_view
        elif field == _NAME:
            try:
                name = str(value_view, "utf-8")
            except UnicodeDecodeError:
                raise _Unusual from None
        else:
            sha256 = bytes(value_view)
    return WireChunk(name, offset, data, crc32, sha256)


def _read_varint(raw: bytes | memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(raw) or shift > 63:
            raise _Unusual
        byte = raw[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
