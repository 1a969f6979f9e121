from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WatchRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("paused", "weight_version", "running_requests", "waiting_requests", "kv_cache_usage", "draining", "live_sessions", "sessions_added", "sessions_removed", "sessions_complete", "prompt_tokens", "cached_prompt_tokens")
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
    def __init__(self, paused: _Optional[bool] = ..., weight_version: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., draining: _Optional[bool] = ..., live_sessions: _Optional[int] = ..., sessions_added: _Optional[_Iterable[str]] = ..., sessions_removed: _Optional[_Iterable[str]] = ..., sessions_complete: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...
