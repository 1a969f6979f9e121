"""Delta updates on the trainer's side: which elements of each parameter changed since the
weights the servers serve, as patches (``skyrl_grpc.patch_format``: indices or a bitmap, then
the new values; zstd-compressed XORs where the server reads them), found on the tensor's own
device, and the whole value where a patch would not be smaller.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from skyrl_grpc import dtypes, patch_format
from skyrl_grpc.tensor_bytes import flat_bytes
from trainer_client.weights.weight_sending import Entry, host_array, parameter_spec, whole_entry

# A patch is sent only when, its changes named by indices, it is smaller than this share of the
# parameter's bytes; a parameter that changed more goes whole. Counted with indices even where a
# bitmap names them in fewer bytes: a patch costs CPU per changed element on both sides (found,
# gathered, scattered, recorded for a rollback), so which parameters are patched stays where it
# was measured; the bitmap only shrinks the patches sent.
PATCH_MAX_FRACTION = 0.5


def weight_patches(
    named_tensors: Iterable[tuple[str, Any]],
    base: dict[str, Any],
    base_version: int,
    with_checksums: bool = True,
    compress: bool = False,
) -> list[Entry]:
    """What changed since ``base`` (the tensors last pushed as ``base_version``), compared bit
    for bit as integers: for each parameter a sparse patch (changed indices and their new
    values), the whole tensor where a patch would not be much smaller or the base lacks it,
    nothing where nothing changed. Runs on the tensors' device (a GPU computes it in
    milliseconds) and leaves the entries there. ``compress``: each patch goes as a zstd frame
    (``patch_format.compress``, made on the host) where that makes it at most
    ``COMPRESSED_MAX_FRACTION`` of its bytes."""
    import torch

    entries: list[Entry] = []
    for name, tensor in named_tensors:
        old = base.get(name)
        itemsize = tensor.element_size()
        if (
            old is None
            or old.shape != tensor.shape
            or old.dtype != tensor.dtype
            or tensor.numel() >= 1 << 32
            or itemsize not in dtypes.BITS_BY_ITEMSIZE
        ):
            entries.append(whole_entry(name, tensor, with_checksums))
            continue
        bits = getattr(torch, dtypes.BITS_BY_ITEMSIZE[itemsize])
        new_bits = flat_bytes(tensor).view(bits)
        old_bits = flat_bytes(old).view(bits).to(new_bits.device)
        if _surely_dense(new_bits, old_bits, itemsize):
            entries.append(whole_entry(name, tensor, with_checksums))
            continue
        changed, patch, indices = _patch_of(new_bits, old_bits, itemsize)
        if changed == 0:
            continue
        if patch is None:  # it changed too much for a patch to be much smaller
            entries.append(whole_entry(name, tensor, with_checksums))
            continue
        spec = parameter_spec(name, tensor, with_checksums)  # SHA-256 of the patched whole
        spec.patch.base_weight_version = base_version
        spec.patch.changed = changed
        spec.patch.bitmap = patch_format.prefers_bitmap(new_bits.numel(), changed)
        if compress:
            frame = _compressed(patch, old_bits, indices, changed, spec.patch.bitmap)
            if frame is not None:
                spec.patch.zstd_bytes = frame.numel()
                patch = frame
        entries.append((spec, patch))
    return entries


# A patch goes compressed only where its frame is at most this share of its bytes: the
# receivers' decompression is not worth a few percent.
COMPRESSED_MAX_FRACTION = 0.9


def _compressed(patch: Any, old_bits: Any, indices: Any, changed: int, bitmap: bool) -> Any:
    """The patch as a zstd frame (a uint8 tensor on the host), or None where that is not
    under ``COMPRESSED_MAX_FRACTION`` of its bytes. XORs need the base values at the changed
    ``indices``: gathered where the base lies (on its device for a GPU trainer), a few bytes
    each."""
    import numpy as np
    import torch

    payload = host_array(patch)
    elements, itemsize = old_bits.numel(), old_bits.element_size()
    if old_bits.device.type == "cpu":
        base_values = np.take(old_bits.numpy(), indices)
    else:
        base_values = old_bits[indices].cpu().numpy()
    frame = patch_format.compress(
        payload, base_values.view(f"<u{itemsize}"), elements, itemsize, changed, bitmap
    )
    if len(frame) > COMPRESSED_MAX_FRACTION * len(payload):
        return None
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8)


def _patch_of(new_bits: Any, old_bits: Any, itemsize: int) -> tuple[int, Any, Any]:
    """How many elements differ, the patch's bytes (``skyrl_grpc.patch_format``: the changed
    elements' indices, or their bitmap where that is smaller, then their new values) on the
    tensors' device, and the changed elements' indices there (a compressed patch needs them);
    None instead of the bytes and indices when the patch would not be under
    ``PATCH_MAX_FRACTION`` of the tensor's bytes (counted before any index is made)."""
    limit = PATCH_MAX_FRACTION * new_bits.numel() * itemsize
    if new_bits.device.type == "cpu":
        # numpy compares, counts and finds the changed elements 2-5x faster than torch on a
        # CPU (one thread, 0.3B parameters: ~0.3 s instead of ~0.6 s).
        return _host_patch_of(new_bits, old_bits, itemsize, limit)
    return _device_patch_of(new_bits, old_bits, itemsize, limit)


# Elements the host path compares at a time: a block's comparison stays in cache while its
# changed elements are found, and no mask of the whole tensor is made (an lr-1e-6 step of the
# 0.3B benchmark model, bf16: 0.34 s with one mask, 0.24-0.28 s in blocks; bound by memory
# bandwidth: splitting the blocks over two threads gained nothing more here).
HOST_BLOCK_ELEMENTS = 1 << 18


def _host_patch_of(
    new_bits: Any, old_bits: Any, itemsize: int, limit: float
) -> tuple[int, Any, Any]:
    import numpy as np
    import torch

    new, old = new_bits.numpy(), old_bits.numpy()
    changed = 0
    found = []
    # Each block's bitmap, made while its comparison is in cache where the block alone would
    # rather be named by one (blocks are a multiple of 8 elements: their bitmaps join as one).
    bitmaps: list[Any] = []
    for start in range(0, new.size, HOST_BLOCK_ELEMENTS):
        end = start + HOST_BLOCK_ELEMENTS
        differs = new[start:end] != old[start:end]
        block = np.flatnonzero(differs)
        dense = patch_format.prefers_bitmap(differs.size, block.size)
        bitmaps.append(np.packbits(differs, bitorder="little") if dense else None)
        if block.size == 0:
            continue
        changed += block.size
        if changed * (patch_format.INDEX_BYTES + itemsize) >= limit:
            return changed, None, None  # a count so far: enough to know the patch does not pay
        found.append((block + start).astype("<u4"))
    if changed == 0:
        return 0, None, None
    indices = np.concatenate(found)
    if patch_format.prefers_bitmap(new.size, changed):
        names = np.concatenate(
            [
                bits if bits is not None else _block_bitmap(indices, start, new.size)
                for bits, start in zip(
                    bitmaps, range(0, new.size, HOST_BLOCK_ELEMENTS), strict=True
                )
            ]
        )
    else:
        names = indices.view(np.uint8)
    patch = np.concatenate([names, new[indices].view(np.uint8)])
    return changed, torch.from_numpy(patch), indices


def _block_bitmap(indices: Any, start: int, elements: int) -> Any:
    """The bitmap of the block of ``HOST_BLOCK_ELEMENTS`` from ``start`` (of a parameter of
    ``elements``), from the parameter's increasing changed ``indices``."""
    import numpy as np

    end = min(start + HOST_BLOCK_ELEMENTS, elements)
    inside = indices[np.searchsorted(indices, start) : np.searchsorted(indices, end)]
    return patch_format.bitmap_of(inside - start, end - start)


def _device_patch_of(
    new_bits: Any, old_bits: Any, itemsize: int, limit: float
) -> tuple[int, Any, Any]:
    import torch

    differs = new_bits != old_bits
    changed = int(torch.count_nonzero(differs))  # a sum of bools is several times slower
    if changed == 0 or changed * (patch_format.INDEX_BYTES + itemsize) >= limit:
        return changed, None, None
    indices = differs.nonzero().reshape(-1)
    if patch_format.prefers_bitmap(new_bits.numel(), changed):
        names = _packed_bits(differs)
    else:
        # int32 has the same bytes as uint32 below 2**32 (the device is little-endian).
        names = indices.to(torch.int32).view(torch.uint8)
    del differs
    return changed, torch.cat([names, new_bits[indices].view(torch.uint8)]), indices


def _packed_bits(mask: Any) -> Any:
    """A bool tensor as bytes of 8 elements each, least significant bit first (numpy's
    ``packbits(bitorder="little")``), on the mask's device."""
    import torch

    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


# Elements compared to guess, before comparing them all, that a tensor changed too much for a
# patch (a full update: every element differs), and how far past the limit the guess must be.
SAMPLE_ELEMENTS = 4096
SAMPLE_MARGIN = 1.5


def _surely_dense(new_bits: Any, old_bits: Any, itemsize: int) -> bool:
    """Whether an evenly spaced sample says the tensor goes whole anyway (well past
    ``PATCH_MAX_FRACTION``): then the full comparison, a pass over both copies, is skipped.
    Only the choice between a patch and the whole value rests on it; either is exact."""
    step = max(1, new_bits.numel() // SAMPLE_ELEMENTS)
    sampled = new_bits[::step] != old_bits[::step]
    fraction = float(sampled.sum()) / max(1, sampled.numel())
    per_element = fraction * (patch_format.INDEX_BYTES + itemsize)
    return bool(per_element >= SAMPLE_MARGIN * PATCH_MAX_FRACTION * itemsize)
