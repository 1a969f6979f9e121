from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BackendState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_STATE_UNSPECIFIED: _ClassVar[BackendState]
    BACKEND_STATE_HEALTHY: _ClassVar[BackendState]
    BACKEND_STATE_UNHEALTHY: _ClassVar[BackendState]
    BACKEND_STATE_DRAINING: _ClassVar[BackendState]
BACKEND_STATE_UNSPECIFIED: BackendState
BACKEND_STATE_HEALTHY: BackendState
BACKEND_STATE_UNHEALTHY: BackendState
BACKEND_STATE_DRAINING: BackendState

class Backend(_message.Message):
    __slots__ = ("address", "state", "in_flight", "total_requests", "failed_requests", "paused", "weight_version", "running_requests", "waiting_requests", "live_sessions", "prompt_tokens", "cached_prompt_tokens", "standby", "sampling_seed")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: BackendState
    in_flight: int
    total_requests: int
    failed_requests: int
    paused: bool
    weight_version: int
    running_requests: int
    waiting_requests: int
    live_sessions: int
    prompt_tokens: int
    cached_prompt_tokens: int
    standby: bool
    sampling_seed: int
    def __init__(self, address: _Optional[str] = ..., state: _Optional[_Union[BackendState, str]] = ..., in_flight: _Optional[int] = ..., total_requests: _Optional[int] = ..., failed_requests: _Optional[int] = ..., paused: _Optional[bool] = ..., weight_version: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., live_sessions: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., standby: _Optional[bool] = ..., sampling_seed: _Optional[int] = ...) -> None: ...

class ListBackendsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBackendsResponse(_message.Message):
    __slots__ = ("backends",)
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[Backend]
    def __init__(self, backends: _Optional[_Iterable[_Union[Backend, _Mapping]]] = ...) -> None: ...

class AddBackendRequest(_message.Message):
    __slots__ = ("address", "standby")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    address: str
    standby: bool
    def __init__(self, address: _Optional[str] = ..., standby: _Optional[bool] = ...) -> None: ...

class AddBackendResponse(_message.Message):
    __slots__ = ("backend",)
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    backend: Backend
    def __init__(self, backend: _Optional[_Union[Backend, _Mapping]] = ...) -> None: ...

class RemoveBackendRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RemoveBackendResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainBackendRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class DrainBackendResponse(_message.Message):
    __slots__ = ("remaining_in_flight",)
    REMAINING_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    remaining_in_flight: int
    def __init__(self, remaining_in_flight: _Optional[int] = ...) -> None: ...

class SetStandbyRequest(_message.Message):
    __slots__ = ("address", "standby")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    address: str
    standby: bool
    def __init__(self, address: _Optional[str] = ..., standby: _Optional[bool] = ...) -> None: ...

class SetStandbyResponse(_message.Message):
    __slots__ = ("backend",)
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    backend: Backend
    def __init__(self, backend: _Optional[_Union[Backend, _Mapping]] = ...) -> None: ...

class WatchBackendsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionPlacement(_message.Message):
    __slots__ = ("session_id", "address")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    address: str
    def __init__(self, session_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class WatchBackendsResponse(_message.Message):
    __slots__ = ("backends", "placement", "epsilon", "complete", "sessions_added", "sessions_removed")
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ADDED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[Backend]
    placement: str
    epsilon: float
    complete: bool
    sessions_added: _containers.RepeatedCompositeFieldContainer[SessionPlacement]
    sessions_removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, backends: _Optional[_Iterable[_Union[Backend, _Mapping]]] = ..., placement: _Optional[str] = ..., epsilon: _Optional[float] = ..., complete: _Optional[bool] = ..., sessions_added: _Optional[_Iterable[_Union[SessionPlacement, _Mapping]]] = ..., sessions_removed: _Optional[_Iterable[str]] = ...) -> None: ...
