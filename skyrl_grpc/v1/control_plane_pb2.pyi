from skyrl_grpc.v1 import lora_pb2 as _lora_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
    PAUSE_MODE_KEEP: _ClassVar[PauseMode]

class WeightTransferBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_TRANSFER_BACKEND_UNSPECIFIED: _ClassVar[WeightTransferBackend]
    WEIGHT_TRANSFER_BACKEND_GLOO: _ClassVar[WeightTransferBackend]
    WEIGHT_TRANSFER_BACKEND_NCCL: _ClassVar[WeightTransferBackend]
    WEIGHT_TRANSFER_BACKEND_GRPC_STREAM: _ClassVar[WeightTransferBackend]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    D_TYPE_UNSPECIFIED: _ClassVar[DType]
    D_TYPE_FLOAT32: _ClassVar[DType]
    D_TYPE_FLOAT16: _ClassVar[DType]
    D_TYPE_BFLOAT16: _ClassVar[DType]
    D_TYPE_FLOAT64: _ClassVar[DType]
    D_TYPE_INT8: _ClassVar[DType]
    D_TYPE_UINT8: _ClassVar[DType]
    D_TYPE_INT32: _ClassVar[DType]
    D_TYPE_INT64: _ClassVar[DType]
    D_TYPE_BOOL: _ClassVar[DType]
    D_TYPE_FLOAT8_E4M3FN: _ClassVar[DType]
    D_TYPE_FLOAT8_E5M2: _ClassVar[DType]
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_WAIT: PauseMode
PAUSE_MODE_KEEP: PauseMode
WEIGHT_TRANSFER_BACKEND_UNSPECIFIED: WeightTransferBackend
WEIGHT_TRANSFER_BACKEND_GLOO: WeightTransferBackend
WEIGHT_TRANSFER_BACKEND_NCCL: WeightTransferBackend
WEIGHT_TRANSFER_BACKEND_GRPC_STREAM: WeightTransferBackend
D_TYPE_UNSPECIFIED: DType
D_TYPE_FLOAT32: DType
D_TYPE_FLOAT16: DType
D_TYPE_BFLOAT16: DType
D_TYPE_FLOAT64: DType
D_TYPE_INT8: DType
D_TYPE_UINT8: DType
D_TYPE_INT32: DType
D_TYPE_INT64: DType
D_TYPE_BOOL: DType
D_TYPE_FLOAT8_E4M3FN: DType
D_TYPE_FLOAT8_E5M2: DType

class PauseRequest(_message.Message):
    __slots__ = ("mode", "clear_cache")
    MODE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_CACHE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    clear_cache: bool
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ..., clear_cache: _Optional[bool] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsPausedRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsPausedResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingResponse(_message.Message):
    __slots__ = ("sleeping",)
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    sleeping: bool
    def __init__(self, sleeping: _Optional[bool] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InitWeightTransferRequest(_message.Message):
    __slots__ = ("backend", "master_address", "master_port", "rank_offset", "world_size", "group_name", "timeout_seconds")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    backend: WeightTransferBackend
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    timeout_seconds: int
    def __init__(self, backend: _Optional[_Union[WeightTransferBackend, str]] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., group_name: _Optional[str] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class InitWeightTransferResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartWeightUpdateRequest(_message.Message):
    __slots__ = ("weight_version", "allow_same_version", "owner", "lease_seconds", "push_ticket", "relay")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SAME_VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_TICKET_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    allow_same_version: bool
    owner: str
    lease_seconds: int
    push_ticket: bytes
    relay: WeightRelayRole
    def __init__(self, weight_version: _Optional[int] = ..., allow_same_version: _Optional[bool] = ..., owner: _Optional[str] = ..., lease_seconds: _Optional[int] = ..., push_ticket: _Optional[bytes] = ..., relay: _Optional[_Union[WeightRelayRole, _Mapping]] = ...) -> None: ...

class WeightRelayRole(_message.Message):
    __slots__ = ("address", "parent", "children", "trees")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    address: str
    parent: str
    children: _containers.RepeatedCompositeFieldContainer[WeightRelayTarget]
    trees: _containers.RepeatedCompositeFieldContainer[WeightRelayTree]
    def __init__(self, address: _Optional[str] = ..., parent: _Optional[str] = ..., children: _Optional[_Iterable[_Union[WeightRelayTarget, _Mapping]]] = ..., trees: _Optional[_Iterable[_Union[WeightRelayTree, _Mapping]]] = ...) -> None: ...

class WeightRelayTree(_message.Message):
    __slots__ = ("parent", "children")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    parent: str
    children: _containers.RepeatedCompositeFieldContainer[WeightRelayTarget]
    def __init__(self, parent: _Optional[str] = ..., children: _Optional[_Iterable[_Union[WeightRelayTarget, _Mapping]]] = ...) -> None: ...

class WeightRelayTarget(_message.Message):
    __slots__ = ("address", "push_socket_port", "push_ticket")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PUSH_SOCKET_PORT_FIELD_NUMBER: _ClassVar[int]
    PUSH_TICKET_FIELD_NUMBER: _ClassVar[int]
    address: str
    push_socket_port: int
    push_ticket: bytes
    def __init__(self, address: _Optional[str] = ..., push_socket_port: _Optional[int] = ..., push_ticket: _Optional[bytes] = ...) -> None: ...

class RelayFailure(_message.Message):
    __slots__ = ("address", "code", "message")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    address: str
    code: int
    message: str
    def __init__(self, address: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class RelayFailures(_message.Message):
    __slots__ = ("failures",)
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    failures: _containers.RepeatedCompositeFieldContainer[RelayFailure]
    def __init__(self, failures: _Optional[_Iterable[_Union[RelayFailure, _Mapping]]] = ...) -> None: ...

class StartWeightUpdateResponse(_message.Message):
    __slots__ = ("serving_weight_version", "lease_seconds", "push_socket_port", "push_ticket")
    SERVING_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_SOCKET_PORT_FIELD_NUMBER: _ClassVar[int]
    PUSH_TICKET_FIELD_NUMBER: _ClassVar[int]
    serving_weight_version: int
    lease_seconds: int
    push_socket_port: int
    push_ticket: bytes
    def __init__(self, serving_weight_version: _Optional[int] = ..., lease_seconds: _Optional[int] = ..., push_socket_port: _Optional[int] = ..., push_ticket: _Optional[bytes] = ...) -> None: ...

class ParameterSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "sha256", "patch")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    sha256: bytes
    patch: WeightPatch
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., sha256: _Optional[bytes] = ..., patch: _Optional[_Union[WeightPatch, _Mapping]] = ...) -> None: ...

class WeightPatch(_message.Message):
    __slots__ = ("base_weight_version", "changed", "bitmap", "zstd_bytes")
    BASE_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    BITMAP_FIELD_NUMBER: _ClassVar[int]
    ZSTD_BYTES_FIELD_NUMBER: _ClassVar[int]
    base_weight_version: int
    changed: int
    bitmap: bool
    zstd_bytes: int
    def __init__(self, base_weight_version: _Optional[int] = ..., changed: _Optional[int] = ..., bitmap: _Optional[bool] = ..., zstd_bytes: _Optional[int] = ...) -> None: ...

class PackedParameter(_message.Message):
    __slots__ = ("parameter", "offset_bytes")
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    parameter: ParameterSpec
    offset_bytes: int
    def __init__(self, parameter: _Optional[_Union[ParameterSpec, _Mapping]] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class WeightBucket(_message.Message):
    __slots__ = ("parameters", "size_bytes")
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    parameters: _containers.RepeatedCompositeFieldContainer[PackedParameter]
    size_bytes: int
    def __init__(self, parameters: _Optional[_Iterable[_Union[PackedParameter, _Mapping]]] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("buckets",)
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[WeightBucket]
    def __init__(self, buckets: _Optional[_Iterable[_Union[WeightBucket, _Mapping]]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("parameters_staged", "bytes_received")
    PARAMETERS_STAGED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    parameters_staged: int
    bytes_received: int
    def __init__(self, parameters_staged: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("parameters",)
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    def __init__(self, parameters: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("name", "offset_bytes", "data", "sha256", "crc32")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset_bytes: int
    data: bytes
    sha256: bytes
    crc32: int
    def __init__(self, name: _Optional[str] = ..., offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightManifest
    chunk: WeightChunk
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[WeightChunk, _Mapping]] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("parameters_staged", "bytes_received")
    PARAMETERS_STAGED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    parameters_staged: int
    bytes_received: int
    def __init__(self, parameters_staged: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class PushSocketHello(_message.Message):
    __slots__ = ("ticket", "relayed_from", "relay_tree")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FROM_FIELD_NUMBER: _ClassVar[int]
    RELAY_TREE_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    relayed_from: str
    relay_tree: int
    def __init__(self, ticket: _Optional[bytes] = ..., relayed_from: _Optional[str] = ..., relay_tree: _Optional[int] = ...) -> None: ...

class PushSocketReply(_message.Message):
    __slots__ = ("response", "code", "message", "relay_failures")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RELAY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    response: PushWeightsResponse
    code: int
    message: str
    relay_failures: _containers.RepeatedCompositeFieldContainer[RelayFailure]
    def __init__(self, response: _Optional[_Union[PushWeightsResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., relay_failures: _Optional[_Iterable[_Union[RelayFailure, _Mapping]]] = ...) -> None: ...

class FinishWeightUpdateRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...

class FinishWeightUpdateResponse(_message.Message):
    __slots__ = ("weight_version", "parameters_updated")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    parameters_updated: int
    def __init__(self, weight_version: _Optional[int] = ..., parameters_updated: _Optional[int] = ...) -> None: ...

class CancelWeightUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CancelWeightUpdateResponse(_message.Message):
    __slots__ = ("parameters_discarded",)
    PARAMETERS_DISCARDED_FIELD_NUMBER: _ClassVar[int]
    parameters_discarded: int
    def __init__(self, parameters_discarded: _Optional[int] = ...) -> None: ...

class RollbackWeightUpdateRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...

class RollbackWeightUpdateResponse(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...

class ReleaseRollbackRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...

class ReleaseRollbackResponse(_message.Message):
    __slots__ = ("released_bytes",)
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    released_bytes: int
    def __init__(self, released_bytes: _Optional[int] = ...) -> None: ...

class ReadWeightsRequest(_message.Message):
    __slots__ = ("chunk_bytes",)
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    chunk_bytes: int
    def __init__(self, chunk_bytes: _Optional[int] = ...) -> None: ...

class ReadWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "manifest", "chunk")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    manifest: WeightManifest
    chunk: WeightChunk
    def __init__(self, weight_version: _Optional[int] = ..., manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[WeightChunk, _Mapping]] = ...) -> None: ...

class GetWeightChecksumsRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class ParameterChecksum(_message.Message):
    __slots__ = ("name", "sha256", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: bytes
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class GetWeightChecksumsResponse(_message.Message):
    __slots__ = ("checksums", "weight_version")
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    checksums: _containers.RepeatedCompositeFieldContainer[ParameterChecksum]
    weight_version: int
    def __init__(self, checksums: _Optional[_Iterable[_Union[ParameterChecksum, _Mapping]]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("sleep", "weight_transfer_backends", "pause_modes", "prefix_caching", "lora", "compressed_weight_patches", "weight_relay", "weight_relay_trees", "protocols", "routed_experts")
    SLEEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MODES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_WEIGHT_PATCHES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_RELAY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_RELAY_TREES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOLS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    sleep: bool
    weight_transfer_backends: _containers.RepeatedScalarFieldContainer[WeightTransferBackend]
    pause_modes: _containers.RepeatedScalarFieldContainer[PauseMode]
    prefix_caching: bool
    lora: _lora_pb2.LoraCapabilities
    compressed_weight_patches: bool
    weight_relay: bool
    weight_relay_trees: bool
    protocols: _containers.RepeatedScalarFieldContainer[str]
    routed_experts: bool
    def __init__(self, sleep: _Optional[bool] = ..., weight_transfer_backends: _Optional[_Iterable[_Union[WeightTransferBackend, str]]] = ..., pause_modes: _Optional[_Iterable[_Union[PauseMode, str]]] = ..., prefix_caching: _Optional[bool] = ..., lora: _Optional[_Union[_lora_pb2.LoraCapabilities, _Mapping]] = ..., compressed_weight_patches: _Optional[bool] = ..., weight_relay: _Optional[bool] = ..., weight_relay_trees: _Optional[bool] = ..., protocols: _Optional[_Iterable[str]] = ..., routed_experts: _Optional[bool] = ...) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("world_size", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "capabilities", "weight_version", "engine", "engine_version", "server_version", "served_model_name", "device", "open_weight_update", "rollback_weight_version", "weight_transfer_group", "weight_group_ranks", "push_socket_port")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    OPEN_WEIGHT_UPDATE_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_GROUP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_GROUP_RANKS_FIELD_NUMBER: _ClassVar[int]
    PUSH_SOCKET_PORT_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    capabilities: Capabilities
    weight_version: int
    engine: str
    engine_version: str
    server_version: str
    served_model_name: str
    device: str
    open_weight_update: OpenWeightUpdate
    rollback_weight_version: int
    weight_transfer_group: WeightTransferGroup
    weight_group_ranks: int
    push_socket_port: int
    def __init__(self, world_size: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., data_parallel_size: _Optional[int] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., weight_version: _Optional[int] = ..., engine: _Optional[str] = ..., engine_version: _Optional[str] = ..., server_version: _Optional[str] = ..., served_model_name: _Optional[str] = ..., device: _Optional[str] = ..., open_weight_update: _Optional[_Union[OpenWeightUpdate, _Mapping]] = ..., rollback_weight_version: _Optional[int] = ..., weight_transfer_group: _Optional[_Union[WeightTransferGroup, _Mapping]] = ..., weight_group_ranks: _Optional[int] = ..., push_socket_port: _Optional[int] = ...) -> None: ...

class WeightTransferGroup(_message.Message):
    __slots__ = ("group_name", "master_address", "master_port", "rank_offset", "world_size")
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    def __init__(self, group_name: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class OpenWeightUpdate(_message.Message):
    __slots__ = ("owner", "age_seconds", "idle_seconds", "lease_seconds", "weight_version", "parameters_staged", "bytes_received")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_STAGED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    owner: str
    age_seconds: float
    idle_seconds: float
    lease_seconds: int
    weight_version: int
    parameters_staged: int
    bytes_received: int
    def __init__(self, owner: _Optional[str] = ..., age_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., lease_seconds: _Optional[int] = ..., weight_version: _Optional[int] = ..., parameters_staged: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_cache_usage", "paused")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    paused: bool
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., paused: _Optional[bool] = ...) -> None: ...

class LoraAdapterSpec(_message.Message):
    __slots__ = ("name", "path", "config_json", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    config_json: str
    version: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., config_json: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("spec", "manifest", "chunk")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    spec: LoraAdapterSpec
    manifest: WeightManifest
    chunk: WeightChunk
    def __init__(self, spec: _Optional[_Union[LoraAdapterSpec, _Mapping]] = ..., manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[WeightChunk, _Mapping]] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("adapter", "replaced_version")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    REPLACED_VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter: _lora_pb2.LoraAdapter
    replaced_version: int
    def __init__(self, adapter: _Optional[_Union[_lora_pb2.LoraAdapter, _Mapping]] = ..., replaced_version: _Optional[int] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[_lora_pb2.LoraAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[_lora_pb2.LoraAdapter, _Mapping]]] = ...) -> None: ...

class ReadLoraAdapterRequest(_message.Message):
    __slots__ = ("name", "chunk_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    chunk_bytes: int
    def __init__(self, name: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ReadLoraAdapterResponse(_message.Message):
    __slots__ = ("spec", "manifest", "chunk")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    spec: LoraAdapterSpec
    manifest: WeightManifest
    chunk: WeightChunk
    def __init__(self, spec: _Optional[_Union[LoraAdapterSpec, _Mapping]] = ..., manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[WeightChunk, _Mapping]] = ...) -> None: ...
