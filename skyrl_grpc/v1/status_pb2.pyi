from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("paused", "weight_version", "running_requests", "waiting_requests", "kv_cache_usage", "draining", "live_sessions", "sessions_added", "sessions_removed", "sessions_complete", "prompt_tokens", "cached_prompt_tokens", "adapters", "recent_updates", "sampling_seed")
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ADDED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RECENT_UPDATES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    weight_version: int
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    draining: bool
    live_sessions: int
    sessions_added: _containers.RepeatedScalarFieldContainer[str]
    sessions_removed: _containers.RepeatedScalarFieldContainer[str]
    sessions_complete: bool
    prompt_tokens: int
    cached_prompt_tokens: int
    adapters: _containers.RepeatedScalarFieldContainer[str]
    recent_updates: _containers.RepeatedCompositeFieldContainer[WeightUpdateRecord]
    sampling_seed: int
    def __init__(self, paused: _Optional[bool] = ..., weight_version: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., draining: _Optional[bool] = ..., live_sessions: _Optional[int] = ..., sessions_added: _Optional[_Iterable[str]] = ..., sessions_removed: _Optional[_Iterable[str]] = ..., sessions_complete: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., adapters: _Optional[_Iterable[str]] = ..., recent_updates: _Optional[_Iterable[_Union[WeightUpdateRecord, _Mapping]]] = ..., sampling_seed: _Optional[int] = ...) -> None: ...

class WeightUpdateRecord(_message.Message):
    __slots__ = ("weight_version", "outcome", "phase_seconds", "bytes", "ended_at_unix_seconds")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    outcome: str
    phase_seconds: _containers.ScalarMap[str, float]
    bytes: int
    ended_at_unix_seconds: float
    def __init__(self, weight_version: _Optional[int] = ..., outcome: _Optional[str] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., bytes: _Optional[int] = ..., ended_at_unix_seconds: _Optional[float] = ...) -> None: ...
