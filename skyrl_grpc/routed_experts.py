"""The experts a mixture-of-experts model routed each token to (routing replay, "R3"), as the
contract carries them (``RoutedExperts``): one packed array per message (a step's tokens, or a
whole sample's), with its shape beside it; no base64, no ``.npy`` header.

vLLM hands them over as an integer array ``[tokens, layers, experts per token]``
(``CompletionOutput.routed_experts``); the server sends each engine step's rows with that
step's tokens, and ``concatenate`` joins a sample's steps; ``pack`` makes the message,
``unpack`` gives the array back (``numpy``, unsigned, the narrowest of 1, 2 or 4 bytes).

Two packings, both exact for what routing replay uses:

- **ordered** (the default): every id in the fewest whole bytes that hold the largest (1 up
  to 256 experts, as vLLM's capture), in the engine's order (its ranking by gate weight):
  packing and unpacking are a copy;
- **as sets** (``as_sets=True``): a token's experts in one layer are one value, the set's rank
  in the combinatorial number system (``C(experts, top-k)`` values: 41 bits for 8 of 128
  against 56 ordered). Unpacked in ascending id order: routing replay gathers the gate's
  weights at the replayed ids, so their order carries nothing it uses. It costs the server
  and the trainer ~1 ms of CPU each per 7,000 sets (``bench_routed_experts``). Arrays whose
  sets do not fit (a repeated id in a set, or more than 2**64 sets) are packed ordered."""

from __future__ import annotations

import base64
import functools
import io
from math import comb, factorial
from typing import Any

import numpy as np

from skyrl_grpc.v1 import generation_pb2

_KINDS = ((8, np.uint8), (16, np.uint16), (32, np.uint32), (64, np.uint64))


def _kind(bits: int) -> Any:
    """The narrowest unsigned type of 8, 16, 32 or 64 bits that holds ``bits`` bits."""
    return next(kind for width, kind in _KINDS if bits <= width)


def _positions(count: int, bits: int) -> tuple[Any, Any]:
    """Each of ``count`` values' 64-bit word and bit offset in it, packed ``bits`` bits apart."""
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(bits)
    return (offsets >> np.uint64(6)).astype(np.intp), offsets & np.uint64(63)


def _pack_bits(values: Any, bits: int) -> bytes:
    """``values`` (unsigned, each below 2**bits) back to back in ``bits`` bits each, least
    significant bit first: in 64-bit words, a value's low part in its word and what passes
    the word's end at the start of the next (the values' bits never overlap, so a word's
    parts add up to their OR)."""
    kind = _kind(bits)
    if bits == np.dtype(kind).itemsize * 8:
        return bytes(values.astype(np.dtype(kind).newbyteorder("<"), copy=False).tobytes())
    wide = values.astype(np.uint64).reshape(-1)
    word, shift = _positions(wide.size, bits)
    words = np.zeros((wide.size * bits + 63) // 64, np.uint64)
    if wide.size:
        starts = np.flatnonzero(np.diff(word, prepend=-1))
        words[word[starts]] = np.add.reduceat(wide << shift, starts)
        over = np.flatnonzero(shift + np.uint64(bits) > 64)
        words[word[over] + 1] += wide[over] >> (np.uint64(64) - shift[over])
    return bytes(words.astype("<u8").tobytes()[: (wide.size * bits + 7) // 8])


def _unpack_bits(data: bytes, count: int, bits: int) -> Any:
    """The ``count`` values ``_pack_bits`` packed in ``bits`` bits each."""
    kind = np.dtype(_kind(bits)).newbyteorder("<")
    if bits == kind.itemsize * 8:
        return np.frombuffer(data, dtype=kind, count=count)
    padded = bytes(data) + bytes(-len(data) % 8 + 8)  # whole words, and one past the last
    words = np.frombuffer(padded, dtype="<u8").astype(np.uint64)
    word, shift = _positions(count, bits)
    low = words[word] >> shift
    high = np.where(shift > 0, words[word + 1] << ((np.uint64(64) - shift) & np.uint64(63)), 0)
    mask = np.uint64((1 << bits) - 1)
    return ((low | high.astype(np.uint64)) & mask).astype(kind)


@functools.lru_cache(maxsize=16)
def _binomials(experts: int, per_token: int) -> Any:
    """``table[n, i] = C(n, i)`` for ``n <= experts``, ``i <= per_token`` (uint64, read-only:
    shared by every call for the same model)."""
    table = np.array(
        [[comb(n, i) for i in range(per_token + 1)] for n in range(experts + 1)], dtype=np.uint64
    )
    table.flags.writeable = False
    return table


def _set_bits(experts: int, per_token: int) -> int:
    """Bits per set's rank: the fewest that hold C(experts, per_token) - 1."""
    return max(1, (comb(experts, per_token) - 1).bit_length())


def _set_ranks(array: Any, experts: int) -> Any | None:
    """Each ``[token, layer]`` row's set of ids ranked (``sum C(id_i, i + 1)`` over its ids in
    ascending order); None where a row repeats an id or the ranks do not fit 64 bits."""
    per_token = array.shape[2]
    if max(comb(experts, i) for i in range(per_token + 1)) > 2**64 - 1:  # the table's largest
        return None
    ordered = np.sort(array.reshape(-1, per_token).astype(np.int64), axis=1)
    if per_token > 1 and bool((np.diff(ordered, axis=1) == 0).any()):
        return None
    table = _binomials(experts, per_token)
    return table[ordered, np.arange(1, per_token + 1)].sum(axis=1, dtype=np.uint64)


def _sets_from_ranks(ranks: Any, experts: int, per_token: int) -> Any:
    """Each rank's ids in ascending order, ``[len(ranks), per_token]``: the largest id first,
    the largest ``n`` with ``C(n, i) <= rest``, guessed from ``C(n, i) ~ (n - (i - 1) / 2) ** i
    / i!`` and moved to the exact one by comparing with the table (a binary search per rank
    costs several times more: its branches are unpredictable)."""
    table = _binomials(experts, per_token)
    rest = ranks.astype(np.uint64)
    ids = np.empty((per_token, rest.size), dtype=np.intp)
    for i in range(per_token, 0, -1):
        column = np.ascontiguousarray(table[:, i])
        estimate = np.power(rest.astype(np.float64) * factorial(i), 1.0 / i) + (i - 1) / 2
        found = np.clip(np.floor(estimate).astype(np.intp), i - 1, experts - 1)
        while (above := column[found] > rest).any():
            found -= above
        while (below := column[found + 1] <= rest).any():  # found < experts - 1: ranks checked
            found += below
        ids[i - 1] = found
        rest = rest - column[found]
    return ids.T


def pack(experts: Any, *, as_sets: bool = False) -> generation_pb2.RoutedExperts:
    """``experts`` (an integer array ``[tokens, layers, per_token]``) packed: ordered, or with
    ``as_sets`` each token's experts in a layer as a set (see the module)."""
    array = np.asarray(experts)
    if array.ndim != 3:
        raise ValueError(f"routed experts of shape {array.shape}: want [tokens, layers, top-k]")
    if array.size and int(array.min()) < 0:
        raise ValueError("routed experts hold a negative expert id")
    largest = int(array.max()) if array.size else 0
    tokens, layers, per_token = array.shape
    message = generation_pb2.RoutedExperts(tokens=tokens, layers=layers, per_token=per_token)
    ranks = _set_ranks(array, largest + 1) if as_sets and array.size else None
    if ranks is not None:
        message.as_sets = True
        message.experts = largest + 1
        message.bits = _set_bits(largest + 1, per_token)
        message.ids = _pack_bits(ranks, message.bits)
        return message
    message.bits = next(width for width, kind in _KINDS if largest <= np.iinfo(kind).max)
    message.width = message.bits // 8  # the same bytes, for readers of the byte packing
    message.ids = _pack_bits(array, message.bits)
    return message


def unpack(message: generation_pb2.RoutedExperts) -> Any:
    """The array ``[tokens, layers, per_token]`` ``message`` packs (a set's ids ascending)."""
    shape = (message.tokens, message.layers, message.per_token)
    bits = message.bits or message.width * 8
    if bits < 1 or bits > 64 or (not message.bits and message.width not in (1, 2, 4)):
        raise ValueError(f"routed experts {bits} bits wide: want 1 to 64 bits, or 1, 2 or 4 bytes")
    values = message.tokens * message.layers * (1 if message.as_sets else message.per_token)
    want = (values * bits + 7) // 8
    if len(message.ids) != want:
        raise ValueError(f"routed experts of shape {shape}: {len(message.ids)} bytes, want {want}")
    if not message.as_sets:
        return _unpack_bits(message.ids, values, bits).reshape(shape)
    if message.experts < message.per_token:
        raise ValueError(f"routed experts as sets of {message.per_token} of {message.experts}")
    ranks = _unpack_bits(message.ids, values, bits)
    if ranks.size and int(ranks.max()) >= comb(message.experts, message.per_token):
        raise ValueError(
            f"routed experts as sets: a rank beyond C({message.experts}, {message.per_token})"
        )
    ids = _sets_from_ranks(ranks, message.experts, message.per_token)
    return ids.astype(_kind(max(1, (message.experts - 1).bit_length()))).reshape(shape)


def concatenate(
    earlier: generation_pb2.RoutedExperts, later: generation_pb2.RoutedExperts
) -> generation_pb2.RoutedExperts:
    """One message holding ``earlier``'s tokens then ``later``'s (a sample's steps merged):
    ordered ids of one width are joined as they are; otherwise both are unpacked and packed
    again, as sets if either was."""
    if earlier.tokens == 0:
        return later
    if later.tokens == 0:
        return earlier
    if (earlier.layers, earlier.per_token) != (later.layers, later.per_token):
        raise ValueError(
            f"routed experts of {earlier.layers} layers, {earlier.per_token} per token and of "
            f"{later.layers}, {later.per_token} cannot be joined"
        )
    if not earlier.as_sets and not later.as_sets and earlier.bits == later.bits:
        joined = generation_pb2.RoutedExperts()
        joined.CopyFrom(earlier)
        joined.tokens += later.tokens
        joined.ids = earlier.ids + later.ids  # whole bytes: 8, 16 or 32 bits an id
        return joined
    if earlier.as_sets and later.as_sets:  # a set's rank does not depend on the base: join
        # the ranks, in the bits the larger base needs
        ranks = [
            _unpack_bits(part.ids, part.tokens * part.layers, part.bits)
            for part in (earlier, later)
        ]
        joined = generation_pb2.RoutedExperts(
            tokens=earlier.tokens + later.tokens,
            layers=earlier.layers,
            per_token=earlier.per_token,
            as_sets=True,
            experts=max(earlier.experts, later.experts),
        )
        joined.bits = _set_bits(joined.experts, joined.per_token)
        joined.ids = _pack_bits(np.concatenate(ranks), joined.bits)
        return joined
    both = np.concatenate([unpack(earlier), unpack(later)])
    return pack(both, as_sets=earlier.as_sets or later.as_sets)


def as_sets(message: generation_pb2.RoutedExperts) -> generation_pb2.RoutedExperts:
    """``message`` packed as sets (as it is where it already was)."""
    if message.as_sets or message.tokens == 0:
        return message
    return pack(unpack(message), as_sets=True)


def npy_base64(message: generation_pb2.RoutedExperts) -> str:
    """The experts as vLLM's OpenAI server returns them (its ``numpy2base64``): the array's
    ``.npy`` bytes, base64. Decoded with ``np.load(io.BytesIO(base64.b64decode(text)))``."""
    with io.BytesIO() as buffer:
        np.save(buffer, unpack(message), allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")
