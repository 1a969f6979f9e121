"""Domain errors and their gRPC status codes: the one mapping every server uses.

Handlers raise these; ``servers.interceptors.ErrorMappingInterceptor`` turns them into a status
with the exception's message, which must tell a person what to change. Anything else becomes
INTERNAL with a generic message (the traceback goes to the server log, not the wire).
"""

from __future__ import annotations

import grpc


class SkyrlError(Exception):
    """Base of the errors a server reports as a specific status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(SkyrlError):
    """The request is malformed or out of range; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(SkyrlError):
    """The call is out of order or the server lacks the feature; the message says which."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(SkyrlError):
    """The caller is known but not allowed this (e.g. a relayed stream from a peer the update's
    relay plan does not name)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(SkyrlError):
    """A named thing (backend, parameter, request) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SkyrlError):
    """A thing with this name or id exists already."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Unavailable(SkyrlError):
    """The server cannot serve now (starting, draining, no healthy backend); retry later."""

    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(SkyrlError):
    """A capacity limit was reached (e.g. too many requests waiting); the message names the
    limit and the flag that raises it."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(SkyrlError):
    """An internal wait (e.g. for other ranks) ran out of time."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Aborted(SkyrlError):
    """What the call read changed under it (e.g. the serving weights moved on); call again."""

    code = grpc.StatusCode.ABORTED


class Unimplemented(SkyrlError):
    """The call, or a field of it, has no mapping on this server (e.g. a field of another
    protocol it serves); the message says what to send instead."""

    code = grpc.StatusCode.UNIMPLEMENTED


class DataLoss(SkyrlError):
    """Bytes arrived corrupted (a checksum did not match)."""

    code = grpc.StatusCode.DATA_LOSS


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_of(number: int) -> grpc.StatusCode:
    """The status a numeric code names (as ``BatchError.code`` carries it); UNKNOWN for a
    number gRPC does not define."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_with(code: grpc.StatusCode, message: str) -> SkyrlError:
    """An error reported as ``code`` with ``message`` (a status relayed from another server)."""
    error = SkyrlError(message)
    error.code = code
    return error


# What grpc's own client core reports when the connection broke under a call in flight (a
# batch operation failed: the peer's process died between messages). No server sent it, and
# it means what UNAVAILABLE means: the server was lost, the call may move elsewhere.
TRANSPORT_BROKE = "Internal error from Core"


def call_status(error: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """A failed call's status as a caller should act on it: a connection that broke under the
    call is UNAVAILABLE (with a message that says so), every other status is the server's."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.INTERNAL and details == TRANSPORT_BROKE:
        return grpc.StatusCode.UNAVAILABLE, f"the connection broke mid-call ({details})"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and OVER_SIZE in details:
        return code, f"{details}: {OVER_SIZE_HINT}"
    if code == grpc.StatusCode.UNAVAILABLE and WRONG_HOST in details:
        return code, f"{details}: {WRONG_HOST_HINT}"
    return code, details


#: gRPC's own words for a TLS server whose certificate names neither the address dialled nor
#: the override, which name neither.
WRONG_HOST = "Hostname Verification Check failed"
WRONG_HOST_HINT = (
    "the server's TLS certificate does not name the host or address this client dialled: give "
    "it a certificate that does (a subject alternative name per host or IP address), or dial "
    "the name it has (TlsConfig.server_name_override)"
)
#: gRPC's own words for a message over a channel's or server's size limit ("Received message
#: larger than max (N vs. M)", "Sent message larger than max ..."), which name no setting.
OVER_SIZE = "message larger than max"
OVER_SIZE_HINT = (
    "a message over a size limit: the servers' and router's --max-message-mib (default 64) "
    "and the client's max_message_bytes bound every message; raise them together, or send "
    "smaller pieces"
)


def server_lost(error: grpc.aio.AioRpcError) -> bool:
    """The call failed because its server could not be reached or went away mid-call."""
    return call_status(error)[0] == grpc.StatusCode.UNAVAILABLE
