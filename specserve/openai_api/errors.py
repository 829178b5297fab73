"""OpenAI error bodies, and the HTTP status each gRPC status code becomes.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with the
matching HTTP status, whether the HTTP layer refused the request itself (bad JSON,
a bad field) or the orchestrator did (its status code and sentence pass through).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code).
_BY_CODE: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error", None),
    grpc.StatusCode.ABORTED: (409, "conflict_error", None),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "resource_exhausted"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", None),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", None),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", None),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", None),
}


@dataclass
class ApiError(Exception):
    """A request the API answers with an OpenAI error body."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400 invalid_request_error naming the offending field."""
    return ApiError(400, message, "invalid_request_error", param, code)


def from_grpc(error: grpc.aio.AioRpcError) -> ApiError:
    """The orchestrator's refusal as an OpenAI error: its sentence, the mapped status."""
    status, kind, code = _BY_CODE.get(error.code(), (500, "server_error", None))
    details = error.details() or error.code().name
    return ApiError(status, details, kind, None, code or error.code().name.lower())
