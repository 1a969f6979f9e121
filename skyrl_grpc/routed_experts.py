"""The experts a mixture-of-experts model routed each token to (routing replay, "R3"), as the
contract carries them (``RoutedExperts``): one packed array per sample, each id in the fewest
bytes that hold the largest, with its shape beside it; no per-message header, no base64.

vLLM hands them over as an integer array ``[tokens, layers, experts per token]`` on a
sample's last output (``CompletionOutput.routed_experts``); ``pack`` makes the message,
``unpack`` gives the same array back (``numpy``, unsigned, the packed width)."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from skyrl_grpc.v1 import generation_pb2

_WIDTHS = ((1, np.uint8), (2, np.uint16), (4, np.uint32))


def pack(experts: Any) -> generation_pb2.RoutedExperts:
    """``experts`` (an integer array ``[tokens, layers, per_token]``) packed."""
    array = np.asarray(experts)
    if array.ndim != 3:
        raise ValueError(f"routed experts of shape {array.shape}: want [tokens, layers, top-k]")
    largest = int(array.max()) if array.size else 0
    if array.size and int(array.min()) < 0:
        raise ValueError("routed experts hold a negative expert id")
    width, kind = next((w, k) for w, k in _WIDTHS if largest <= np.iinfo(k).max)
    tokens, layers, per_token = array.shape
    return generation_pb2.RoutedExperts(
        ids=array.astype(np.dtype(kind).newbyteorder("<"), copy=False).tobytes(),
        tokens=tokens,
        layers=layers,
        per_token=per_token,
        width=width,
    )


def npy_base64(message: generation_pb2.RoutedExperts) -> str:
    """The experts as vLLM's OpenAI server returns them (its ``numpy2base64``): the array's
    ``.npy`` bytes, base64. Decoded with ``np.load(io.BytesIO(base64.b64decode(text)))``."""
    with io.BytesIO() as buffer:
        np.save(buffer, unpack(message), allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def unpack(message: generation_pb2.RoutedExperts) -> Any:
    """The array ``[tokens, layers, per_token]`` ``message`` packs (read-only)."""
    kinds = dict(_WIDTHS)
    if message.width not in kinds:
        raise ValueError(f"routed experts {message.width} bytes wide: want 1, 2 or 4")
    shape = (message.tokens, message.layers, message.per_token)
    want = message.tokens * message.layers * message.per_token * message.width
    if len(message.ids) != want:
        raise ValueError(f"routed experts of shape {shape}: {len(message.ids)} bytes, want {want}")
    kind = np.dtype(kinds[message.width]).newbyteorder("<")
    return np.frombuffer(message.ids, dtype=kind).reshape(shape)
