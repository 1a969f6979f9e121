"""How a gRPC status reads over HTTP: the status code and OpenAI's error body, so an HTTP
caller sees what a gRPC caller would (400 for a broken rule, 404, 429, 503, ...)."""

from __future__ import annotations

from typing import Any

import grpc

Json = dict[str, Any]

# The gRPC status of a failed call -> the HTTP status and OpenAI error type that say the same.
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def error_body(status: grpc.StatusCode, message: str) -> tuple[int, Json]:
    """The HTTP status and OpenAI error body for a failed call."""
    http, kind = HTTP_STATUS.get(status, (500, "internal_error"))
    return http, {"error": {"message": message, "type": kind, "param": None, "code": http}}
