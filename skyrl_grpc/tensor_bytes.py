"""A tensor's raw bytes, as both sides of a weight update see them: the trainer sends them and
the servers check what they assembled against their SHA-256 (one definition, so the two can
never disagree on what is hashed). torch is imported on use: the contract package needs none.
"""

from __future__ import annotations

import hashlib
from typing import Any


def flat_bytes(tensor: Any) -> Any:
    """A tensor's bytes as a flat uint8 tensor on the tensor's own device (a view when it is
    contiguous)."""
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def sha256_of(tensor: Any) -> bytes:
    """SHA-256 of a tensor's raw bytes (copied to the host first when it lives elsewhere)."""
    return hashlib.sha256(flat_bytes(tensor).cpu().numpy()).digest()
