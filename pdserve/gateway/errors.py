"""HTTP-facing errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can see is an `APIError`; `from_pdserve` translates the project's
exception tree at this boundary, reading the same table as the gRPC mapping
(`pdserve.errors`), so an error has the same meaning on both APIs.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from pdserve.errors import ErrorCode, ErrorKind, PdserveError, kind_of
from pdserve.gateway.protocol import ErrorBody, ErrorResponse, ErrorType

INVALID_REQUEST: ErrorType = "invalid_request_error"
SERVER_ERROR: ErrorType = "server_error"
RATE_LIMIT: ErrorType = "rate_limit_error"
PERMISSION: ErrorType = "permission_error"  # a valid key without the right (HTTP 403)

MAX_MESSAGE_CHARS = 1024  # messages may quote client input (a field name, a value)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: ErrorType = INVALID_REQUEST,
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message)} characters)"
        if param is not None and len(param) > MAX_MESSAGE_CHARS:
            param = param[:MAX_MESSAGE_CHARS] + "..."
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type,
                                             param=self.param, code=self.code)).body()

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status,
                            headers={**self.headers, **(headers or {})})


def bad_request(message: str, *, param: str | None = None,
                code: str | None = ErrorCode.INVALID_REQUEST) -> APIError:
    return APIError(400, message, code=code, param=param)


def unavailable(message: str, *, code: str, retry_after_s: int) -> APIError:
    return APIError(503, message, type=SERVER_ERROR, code=code,
                    headers={"Retry-After": str(retry_after_s)})


def timed_out(timeout_s: float) -> APIError:
    return APIError(504, f"the request did not finish within {timeout_s:g} s",
                    type=SERVER_ERROR, code=ErrorCode.TIMEOUT)


def internal(message: str = "internal server error",
             code: str = ErrorCode.INTERNAL_ERROR) -> APIError:
    return APIError(500, message, type=SERVER_ERROR, code=code)


def overloaded(message: str, *, code: str, retry_after_s: int) -> APIError:
    """429 in OpenAI's rate-limit shape: the client backs off for Retry-After seconds."""
    return APIError(429, message, type=RATE_LIMIT, code=code,
                    headers={"Retry-After": str(retry_after_s)})


def from_pdserve(exc: PdserveError, *, retry_after_s: int) -> APIError:
    """The HTTP error for `exc`: its status comes from `pdserve.errors.kind_of`; the "retry"
    kinds (503, 429) carry Retry-After (an admission refusal's own, else `retry_after_s`)."""
    kind = kind_of(exc)
    if kind is ErrorKind.INVALID_ARGUMENT:
        return bad_request(exc.message, param=exc.param, code=exc.code)
    if kind is ErrorKind.RESOURCE_EXHAUSTED:
        own = getattr(exc, "retry_after_s", None)
        return overloaded(exc.message, code=exc.code,
                          retry_after_s=retry_after_s if own is None else own)
    if kind.http_status == 503:
        return unavailable(exc.message, code=exc.code, retry_after_s=retry_after_s)
    return APIError(kind.http_status, exc.message, type=SERVER_ERROR, code=exc.code)
