"""How every pdserve error reads to a caller, over HTTP and over gRPC, from one table.

`ERROR_CLASSES` is the explicit registry of stable error codes: the class a code stands for,
so a client rebuilds the same exception type from a `pdserve-error-code` trailer. `kind_of`
sorts an exception into an `ErrorKind`, and each kind carries both its gRPC status and its
HTTP status, so an error can never be UNAVAILABLE on one protocol and 500 on the other.

This module imports neither grpc nor the web stack: `pdserve.rpc.errors` (gRPC) and
`pdserve.gateway.errors` (HTTP) are the two readers.
"""

from __future__ import annotations

import enum

from pdserve.types import (
    CapacityError,
    InvalidRequestError,
    KVTransferError,
    ModelLoadError,
    PdserveError,
    PromptTooLongError,
    RequestAbortedError,
    UnsupportedArchitectureError,
)


class OverloadedError(CapacityError):
    """Admission control refused the request: the cluster cannot give it a first token within
    its latency class's deadline, or the router is at its in-flight cap (HTTP 429 with
    Retry-After, gRPC RESOURCE_EXHAUSTED). Nothing was started for it."""

    code = "overloaded"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 reason: str = "overloaded", latency_class: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message, code=code, param=param)
        self.reason = reason  # "in_flight_cap" | "deadline"
        self.latency_class = latency_class
        self.retry_after_s = retry_after_s


class QuotaExceededError(OverloadedError):
    """The caller's API key already has its limit of requests in flight (`pdserve.tenants`):
    HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED. Nothing was started for it."""

    code = "quota_exceeded"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message, code=code, param=param, reason="key_quota",
                         retry_after_s=retry_after_s)


class WorkerTimeoutError(PdserveError):
    """A worker sent nothing within a stage deadline (first token, next token): the request
    was given up, so the client may retry (HTTP 503 / UNAVAILABLE), never a 500."""

    code = "decode_timeout"


class ErrorKind(enum.Enum):
    """(gRPC status name, HTTP status): what the caller should do about an error."""

    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 400)  # the caller's mistake; never retry as is
    UNAVAILABLE = ("UNAVAILABLE", 503)  # busy or going away, not broken: retry later/elsewhere
    CANCELLED = ("CANCELLED", 503)  # the request was aborted on the server side
    # A KV transfer failed: the router retries at a higher level (a new allocation, or local
    # prefill); one that still reaches a client is a server fault to it.
    ABORTED = ("ABORTED", 500)
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 504)
    # Refused early by admission control: retry after the Retry-After the error carries.
    RESOURCE_EXHAUSTED = ("RESOURCE_EXHAUSTED", 429)
    UNIMPLEMENTED = ("UNIMPLEMENTED", 501)
    INTERNAL = ("INTERNAL", 500)  # a server fault

    @property
    def grpc_status_name(self) -> str:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]


# Stable code -> the class it stands for. Codes not listed here (an instance's own code, e.g.
# CapacityError(code="kv_pending_limit")) keep their class through the status on the wire.
ERROR_CLASSES: dict[str, type[PdserveError]] = {
    PdserveError.code: PdserveError,
    InvalidRequestError.code: InvalidRequestError,
    PromptTooLongError.code: PromptTooLongError,
    CapacityError.code: CapacityError,
    RequestAbortedError.code: RequestAbortedError,
    KVTransferError.code: KVTransferError,
    ModelLoadError.code: ModelLoadError,
    UnsupportedArchitectureError.code: UnsupportedArchitectureError,
    # AsyncEngine's EngineClosedError: the worker is stopping, so the caller should go elsewhere.
    "engine_closed": CapacityError,
    OverloadedError.code: OverloadedError,
    QuotaExceededError.code: QuotaExceededError,
    WorkerTimeoutError.code: WorkerTimeoutError,
}

# Most specific first: the first class an exception is an instance of decides its kind.
_KIND_BY_CLASS: tuple[tuple[type[PdserveError], ErrorKind], ...] = (
    (InvalidRequestError, ErrorKind.INVALID_ARGUMENT),  # PromptTooLongError included
    (OverloadedError, ErrorKind.RESOURCE_EXHAUSTED),
    (WorkerTimeoutError, ErrorKind.UNAVAILABLE),
    (CapacityError, ErrorKind.UNAVAILABLE),
    (RequestAbortedError, ErrorKind.CANCELLED),
    (KVTransferError, ErrorKind.ABORTED),
    (PdserveError, ErrorKind.INTERNAL),
)

# A status with no (known) code in its trailers: the class a client rebuilds.
_CLASS_BY_KIND: dict[ErrorKind, type[PdserveError]] = {
    ErrorKind.INVALID_ARGUMENT: InvalidRequestError,
    ErrorKind.UNAVAILABLE: CapacityError,
    ErrorKind.CANCELLED: RequestAbortedError,
    ErrorKind.ABORTED: KVTransferError,
}

TIMEOUT_CODE = "timeout"
UNIMPLEMENTED_CODE = "unimplemented"


def _class_kind(cls: type[PdserveError]) -> ErrorKind:
    return next(kind for base, kind in _KIND_BY_CLASS if issubclass(cls, base))


def kind_of(exc: BaseException) -> ErrorKind:
    """The kind `exc` is reported as. A plain PdserveError subclass whose code is registered
    to a more specific class (EngineClosedError, "engine_closed") takes that class's kind."""
    if isinstance(exc, PdserveError):
        kind = _class_kind(type(exc))
        registered = ERROR_CLASSES.get(exc.code)
        if kind is ErrorKind.INTERNAL and registered is not None:
            kind = _class_kind(registered)
        return kind
    if isinstance(exc, TimeoutError):  # asyncio.TimeoutError is TimeoutError since 3.11
        return ErrorKind.DEADLINE_EXCEEDED
    if isinstance(exc, NotImplementedError):
        return ErrorKind.UNIMPLEMENTED
    return ErrorKind.INTERNAL


def code_of(exc: BaseException) -> str:
    """The stable code `exc` is reported with."""
    if isinstance(exc, PdserveError):
        return exc.code
    if isinstance(exc, TimeoutError):
        return TIMEOUT_CODE
    if isinstance(exc, NotImplementedError):
        return UNIMPLEMENTED_CODE
    return PdserveError.code


def rebuild(kind: ErrorKind, code: str | None, message: str,
            param: str | None = None) -> PdserveError | TimeoutError:
    """The exception a caller raises for an error received as (`kind`, `code`): the code's
    registered class, else the kind's; DEADLINE_EXCEEDED is a TimeoutError."""
    if kind is ErrorKind.DEADLINE_EXCEEDED:
        return TimeoutError(message)
    cls = ERROR_CLASSES.get(code or "") or _CLASS_BY_KIND.get(kind, PdserveError)
    return cls(message, code=code or cls.code, param=param)


__all__ = ["ERROR_CLASSES", "ErrorKind", "OverloadedError", "WorkerTimeoutError", "code_of",
           "kind_of", "rebuild"]
