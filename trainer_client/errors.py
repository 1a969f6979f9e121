"""The client's exceptions. Every failure a caller sees is one of these.

- ``InferenceError``: base class.
  - ``ServerError``: one call to one address failed; has ``address``, ``code`` (a
    ``grpc.StatusCode``) and ``details``; ``__cause__`` is the original ``grpc.RpcError``.
  - ``FanOutError``: a control call to every server failed on some of them; ``failures`` maps
    each failed address to its ``ServerError``, ``results`` each succeeded address to its result.
    Never a silent partial success.
"""

from __future__ import annotations

from typing import Any

import grpc


class InferenceError(Exception):
    """Base of every error raised by ``trainer_client``."""


class ServerError(InferenceError):
    """A call to ``address`` ended with a non-OK status."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{address}: {code.name}: {details}")
        self.address = address
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, address: str, error: grpc.aio.AioRpcError) -> ServerError:
        wrapped = cls(address, error.code(), error.details() or "")
        wrapped.__cause__ = error
        return wrapped


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
