"""Element types of weights: the contract's DType and torch's names.

One table so the trainer, the server and the worker agree on how bytes are typed.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.v1 import control_plane_pb2 as cp


@dataclass(frozen=True)
class DTypeInfo:
    proto: cp.DType
    torch_name: str  # attribute of the torch module
    itemsize: int


DTYPES = (
    DTypeInfo(cp.D_TYPE_FLOAT32, "float32", 4),
    DTypeInfo(cp.D_TYPE_FLOAT16, "float16", 2),
    DTypeInfo(cp.D_TYPE_BFLOAT16, "bfloat16", 2),
    DTypeInfo(cp.D_TYPE_FLOAT64, "float64", 8),
    DTypeInfo(cp.D_TYPE_INT8, "int8", 1),
    DTypeInfo(cp.D_TYPE_UINT8, "uint8", 1),
    DTypeInfo(cp.D_TYPE_INT32, "int32", 4),
    DTypeInfo(cp.D_TYPE_INT64, "int64", 8),
    DTypeInfo(cp.D_TYPE_BOOL, "bool", 1),
    DTypeInfo(cp.D_TYPE_FLOAT8_E4M3FN, "float8_e4m3fn", 1),
    DTypeInfo(cp.D_TYPE_FLOAT8_E5M2, "float8_e5m2", 1),
)
BY_PROTO: dict[int, DTypeInfo] = {d.proto: d for d in DTYPES}
# The integer type (torch's name) of each element size: weight patches compare and write
# elements as bits, never as float values, on the trainer and in the worker alike.
BITS_BY_ITEMSIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
BY_TORCH = {d.torch_name: d for d in DTYPES}


def from_proto(value: int, where: str = "dtype") -> DTypeInfo:
    try:
        return BY_PROTO[value]
    except KeyError:
        names = ", ".join(cp.DType.Name(d.proto) for d in DTYPES)
        raise InvalidArgument(
            f"{where} = {value} is not a supported DType: use one of {names}"
        ) from None


def torch_name(dtype: object) -> str:
    """torch's name of a ``torch.dtype`` (``torch.float32`` → "float32")."""
    return str(dtype).removeprefix("torch.")


def from_torch(dtype: object) -> DTypeInfo:
    """The entry of a ``torch.dtype`` (e.g. ``torch.float32``)."""
    name = torch_name(dtype)
    try:
        return BY_TORCH[name]
    except KeyError:
        raise InvalidArgument(f"tensors of dtype {name} cannot be transferred") from None


def num_elements(shape: list[int] | tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def num_bytes(shape: list[int] | tuple[int, ...], info: DTypeInfo) -> int:
    return num_elements(shape) * info.itemsize
