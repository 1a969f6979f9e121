"""The client's exceptions.

- ``InferenceError``: base class of what the client raises about the fleet.
  - ``ServerError``: one call to one address failed; has ``address``, ``code`` (a
    ``grpc.StatusCode``) and ``details``; ``__cause__`` is the original ``grpc.RpcError``.
    Raised as the subclass of its status (``NotFound``, ``InvalidArgument``, ``Unavailable``,
    ...), so callers catch what they handle, as with the openai SDK's errors.
  - ``FanOutError``: a control call to every server failed on some of them; ``failures`` maps
    each failed address to its ``ServerError``, ``results`` each succeeded address to its result.
    Never a silent partial success.
  - ``WeightUpdateError`` (``trainer_client.weights.weight_transaction``): a fleet weight
    update failed; says what each server serves now.
  - ``Unsupported``: a fleet-wide call some server cannot take (its ``GetServerInfo``
    capabilities say so), refused before it was sent to any: no server half-done.

Arguments a call refuses before anything is sent raise ``ValueError``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import grpc

from skyrl_grpc.errors import call_status


class InferenceError(Exception):
    """Base of every error ``trainer_client`` raises about the fleet."""


class ServerError(InferenceError):
    """A call to ``address`` ended with a non-OK status (raised as its status's subclass)."""

    # The status this class stands for (None: the base, for statuses without a subclass).
    status: ClassVar[grpc.StatusCode | None] = None

    def __init__(self, address: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{address}: {code.name}: {details}")
        self.address = address
        self.code = code
        self.details = details

    @staticmethod
    def of(address: str, code: grpc.StatusCode, details: str) -> ServerError:
        """The error of ``code``, as its subclass when it has one."""
        return _BY_STATUS.get(code, ServerError)(address, code, details)

    @staticmethod
    def from_rpc_error(address: str, error: grpc.aio.AioRpcError) -> ServerError:
        wrapped = ServerError.of(address, *call_status(error))
        wrapped.__cause__ = error
        return wrapped


class InvalidArgument(ServerError):
    """The request broke a rule; the message names it (and the flag that raises a limit)."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServerError):
    """What the call names does not exist there (a LoRA adapter, a session, a version)."""

    status = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServerError):
    status = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServerError):
    """The server is not in a state for this call (e.g. no weight update open)."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServerError):
    """A server limit was reached (queued requests, message size); retry later or smaller."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServerError):
    """The server could not be reached, or is draining or not ready."""

    status = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServerError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(ServerError):
    """The call lacked the token the server requires (``ClientConfig.token``)."""

    status = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServerError):
    status = grpc.StatusCode.PERMISSION_DENIED


class Aborted(ServerError):
    status = grpc.StatusCode.ABORTED


class Cancelled(ServerError):
    status = grpc.StatusCode.CANCELLED


class Internal(ServerError):
    status = grpc.StatusCode.INTERNAL


_BY_STATUS: dict[grpc.StatusCode, type[ServerError]] = {
    cls.status: cls for cls in ServerError.__subclasses__() if cls.status is not None
}


class FanOutError(InferenceError):
    """Some servers of a fan-out failed; ``results`` holds the others' outcomes."""

    def __init__(
        self, operation: str, failures: dict[str, ServerError], results: dict[str, Any]
    ) -> None:
        failed = "; ".join(f"{a}: {e.code.name}: {e.details}" for a, e in sorted(failures.items()))
        succeeded = ", ".join(sorted(results)) or "none"
        super().__init__(
            f"{operation} failed on {len(failures)} of {len(failures) + len(results)} servers "
            f"({failed}); succeeded on: {succeeded}"
        )
        self.operation = operation
        self.failures = failures
        self.results = results


class Unsupported(InferenceError):
    """A fleet-wide call refused before anything was sent: ``servers`` maps each server that
    cannot take it to why (and the flag or machine that would let it)."""

    def __init__(self, operation: str, servers: dict[str, str]) -> None:
        why = "; ".join(f"{address} {reason}" for address, reason in sorted(servers.items()))
        super().__init__(f"{operation} refused before it was sent to any server: {why}")
        self.operation = operation
        self.servers = servers
