"""Address checks shared by the engine server and the router: host:port and ports in requests.

Request rules specific to the engine live in ``servers.engine.service.validate``.
"""

from __future__ import annotations

from skyrl_grpc.errors import InvalidArgument


def port(value: int, field: str) -> int:
    if not 0 < value < 65536:
        raise InvalidArgument(f"{field} = {value}: a port must be in 1..65535")
    return value


def host_port(value: str, field: str = "address") -> str:
    """``value`` if it is ``host:port`` (e.g. 127.0.0.1:50051)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidArgument(f"{field} {value!r} is not host:port (e.g. 127.0.0.1:50051)")
    return value
