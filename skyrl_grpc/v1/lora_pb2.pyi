from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LoraAdapter(_message.Message):
    __slots__ = ("name", "version", "rank", "target_modules", "lora_alpha", "source", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    lora_alpha: float
    source: str
    sha256: bytes
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., lora_alpha: _Optional[float] = ..., source: _Optional[str] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class LoraCapabilities(_message.Message):
    __slots__ = ("enabled", "max_loras", "max_lora_rank", "max_cpu_loras")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    def __init__(self, enabled: _Optional[bool] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ...) -> None: ...
