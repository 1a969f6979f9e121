"""What a weight update says about the parameters it carries, as plain values: the domain's
view of the contract's ``ParameterSpec``, ``WeightPatch``, ``WeightManifest`` and
``WeightBucket`` (the control plane's converters, ``control_convert``, build these from the
wire). The checks of them against the model are ``assembly``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_grpc import dtypes


@dataclass(frozen=True)
class PatchSpec:
    """A parameter sent as the elements that changed since ``base_weight_version``."""

    base_weight_version: int
    # Elements changed (> 0 for a valid patch).
    changed: int
    # The changed elements are named by a bitmap, not by indices (``patch_format``).
    bitmap: bool = False
    # A compressed patch: the bytes of its zstd frame (0: not compressed).
    zstd_bytes: int = 0


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter as the sender describes it (checkpoint name, element type, shape)."""

    name: str
    dtype: dtypes.DTypeInfo
    shape: tuple[int, ...]
    # SHA-256 of the value (of the patched value for a patch); b"": not checked.
    sha256: bytes = b""
    patch: PatchSpec | None = None


@dataclass(frozen=True)
class Manifest:
    """The parameters an in-band stream (a weight push, an adapter upload) will carry."""

    parameters: tuple[ParameterSpec, ...]


@dataclass(frozen=True)
class PackedParameter:
    """A parameter's place in a broadcast bucket."""

    parameter: ParameterSpec
    offset_bytes: int


@dataclass(frozen=True)
class BucketSpec:
    """One bucket the trainer broadcasts: its parameters and its size in bytes."""

    parameters: tuple[PackedParameter, ...]
    size_bytes: int
