from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScaleRequest(_message.Message):
    __slots__ = ("servers",)
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    servers: int
    def __init__(self, servers: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: FleetMembers
    def __init__(self, members: _Optional[_Union[FleetMembers, _Mapping]] = ...) -> None: ...

class ListMembersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMembersResponse(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: FleetMembers
    def __init__(self, members: _Optional[_Union[FleetMembers, _Mapping]] = ...) -> None: ...

class FleetMembers(_message.Message):
    __slots__ = ("router", "servers", "standbys")
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    STANDBYS_FIELD_NUMBER: _ClassVar[int]
    router: str
    servers: _containers.RepeatedScalarFieldContainer[str]
    standbys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, router: _Optional[str] = ..., servers: _Optional[_Iterable[str]] = ..., standbys: _Optional[_Iterable[str]] = ...) -> None: ...
