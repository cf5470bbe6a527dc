"""Every error pdserve raises on purpose, and how each reads to a caller over HTTP and gRPC.

The one exception tree (`PdserveError` and its subclasses) and the one list of stable error
codes (`ErrorCode`) live here, so an error has one name and one code everywhere. Raise sites
name an `ErrorCode` member, never a bare string; the members are `str`s equal to the codes
on the wire (the `pdserve-error-code` gRPC trailer, the `code` of an OpenAI-style HTTP error
body, kvxfer's reject frames), so `str(ErrorCode.OVERLOADED) == "overloaded"`.

`ERROR_CLASSES` is the explicit registry of codes a client rebuilds a class from; `kind_of`
sorts an exception into an `ErrorKind`, and each kind carries both its gRPC status and its
HTTP status, so an error can never be UNAVAILABLE on one protocol and 500 on the other.

This module imports nothing from the project (and neither grpc nor the web stack), so every
module may raise from it: `pdserve.rpc.errors` (gRPC) and `pdserve.gateway.errors` (HTTP) are
the two readers. What stays in its own module: control flow inside one component that no
caller names (kvxfer's `peers._Retry`, `connections.Idle`, and `peers.Unreachable`, a
KVTransferError its sender catches to forget a descriptor, which callers only ever see as
a KVTransferError), the ValueErrors of record parsers (descriptors, worker records, KV
events, signatures, kvxfer frames), the REST gateway's `APIError` (an HTTP response, built
from these by `pdserve.gateway.errors.from_pdserve`), and the light client's `RouterError`
(`pdserve/client.py` ships alone, so it imports nothing from pdserve).
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Every stable, machine-readable error code, once. A member's name is its value in upper
    case. Codes are an API: never rename one; add a member for a new failure."""

    # The defaults of the exception classes below.
    INTERNAL_ERROR = "internal_error"
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    NO_CAPACITY = "no_capacity"
    ABORTED = "aborted"
    MODEL_LOAD_ERROR = "model_load_error"
    UNSUPPORTED_ARCHITECTURE = "unsupported_architecture"
    KV_TRANSFER_ERROR = "kv_transfer_error"
    OVERLOADED = "overloaded"
    QUOTA_EXCEEDED = "quota_exceeded"
    DECODE_TIMEOUT = "decode_timeout"
    ENGINE_CLOSED = "engine_closed"
    CONTROL_PLANE_UNAVAILABLE = "control_plane_unavailable"
    WORKER_LOST = "worker_lost"
    REMOTE_PREFILL_FAILED = "remote_prefill_failed"

    # Failures that are not a PdserveError, as reported on the wire.
    TIMEOUT = "timeout"  # TimeoutError: a deadline passed (gRPC DEADLINE_EXCEEDED, HTTP 504)
    UNIMPLEMENTED = "unimplemented"  # NotImplementedError
    UNAUTHENTICATED = "unauthenticated"  # a worker refused a call without the cluster token
    WORKER_UNAVAILABLE = "worker_unavailable"  # UNAVAILABLE with no code: a dead worker

    # The caller's mistakes (InvalidRequestError: HTTP 400, INVALID_ARGUMENT).
    INVALID_LATENCY_CLASS = "invalid_latency_class"
    INVALID_REQUEST_ID = "invalid_request_id"
    INVALID_SAMPLING_PARAMS = "invalid_sampling_params"
    EMPTY_PROMPT = "empty_prompt"
    INVALID_MESSAGE = "invalid_message"  # a gRPC request message that does not parse
    INVALID_MESSAGES = "invalid_messages"  # chat messages the template cannot render
    CHAT_TEMPLATE_MISSING = "chat_template_missing"
    INVALID_JSON_SCHEMA = "invalid_json_schema"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    MODEL_NOT_FOUND = "model_not_found"

    # The REST gateway's own (HTTP only, never a PdserveError).
    REQUEST_TOO_LARGE = "request_too_large"
    INVALID_JSON = "invalid_json"
    JSON_TOO_DEEP = "json_too_deep"
    UNKNOWN_PARAMETER = "unknown_parameter"
    MISSING_PARAMETER = "missing_parameter"
    INVALID_TYPE = "invalid_type"
    INVALID_VALUE = "invalid_value"
    INVALID_API_KEY = "invalid_api_key"
    PERMISSION_DENIED = "permission_denied"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HTTP_ERROR = "http_error"
    NOT_READY = "not_ready"
    ENGINE_ERROR = "engine_error"  # the engine failed a request mid-stream

    # Busy or lost workers, and the router's attempts (CapacityError and kin: retryable).
    WORKER_FULL = "worker_full"
    WORKER_DRAINING = "worker_draining"
    KV_PENDING_LIMIT = "kv_pending_limit"
    NO_DECODE_WORKER = "no_decode_worker"
    MIGRATION_EXHAUSTED = "migration_exhausted"
    FIRST_TOKEN_DEADLINE = "first_token_deadline"
    REMOTE_UNSUPPORTED = "remote_unsupported"
    ALLOCATE_FAILED = "allocate_failed"
    PREFILL_WORKER_LOST = "prefill_worker_lost"
    PREFILL_FAILED = "prefill_failed"
    TRANSFER_FAILED = "transfer_failed"
    LEASE_SUPERSEDED = "lease_superseded"

    # KV transfer (KVTransferError; kvxfer's reject and failed frames carry them too).
    KV_PROTOCOL = "kv_protocol"  # a completion notice the handover codec did not write
    KV_STALE_DESCRIPTOR = "kv_stale_descriptor"
    KV_DESCRIPTOR_NOT_FOUND = "kv_descriptor_not_found"
    KV_DESCRIPTOR_LOOKUP_FAILED = "kv_descriptor_lookup_failed"
    KV_UNKNOWN_TRANSFER = "kv_unknown_transfer"
    KV_DUPLICATE_TRANSFER = "kv_duplicate_transfer"
    KV_BLOCK_OUT_OF_RANGE = "kv_block_out_of_range"
    KV_BLOCK_MISMATCH = "kv_block_mismatch"
    KV_LAYOUT_MISMATCH = "kv_layout_mismatch"
    KV_PROTOCOL_ERROR = "kv_protocol_error"
    KV_INVALID_ARGUMENT = "kv_invalid_argument"
    KV_CONNECT_FAILED = "kv_connect_failed"
    KV_PEER_GONE = "kv_peer_gone"
    KV_TIMEOUT = "kv_timeout"
    KV_CANCELLED = "kv_cancelled"
    KV_FENCE_FAILED = "kv_fence_failed"
    KV_CLOSED = "kv_closed"
    KV_UNAUTHENTICATED = "kv_unauthenticated"  # see kvxfer.auth
    KV_TOO_MANY_CONNECTIONS = "kv_too_many_connections"
    KV_INTEGRITY_FAILED = "kv_integrity_failed"  # a run's bytes do not match the signed digest


# --------------------------------------------------------------------------- the tree


class PdserveError(Exception):
    """Root of every error pdserve raises on purpose. `code` is stable and machine-readable:
    an `ErrorCode` member where raised, the code as sent where rebuilt from the wire (so
    every class types it `str`)."""

    code: str = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param


class InvalidRequestError(PdserveError):
    """The caller sent something we will never accept (maps to HTTP 400 / INVALID_ARGUMENT)."""

    code: str = ErrorCode.INVALID_REQUEST


class PromptTooLongError(InvalidRequestError):
    code: str = ErrorCode.CONTEXT_LENGTH_EXCEEDED


class CapacityError(PdserveError):
    """No worker can take the request now; retrying later may work (HTTP 503 / UNAVAILABLE)."""

    code: str = ErrorCode.NO_CAPACITY


class OverloadedError(CapacityError):
    """Admission control refused the request: the cluster cannot give it a first token within
    its latency class's deadline, or the router is at its in-flight cap (HTTP 429 with
    Retry-After, gRPC RESOURCE_EXHAUSTED). Nothing was started for it."""

    code: str = ErrorCode.OVERLOADED

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

    code: str = ErrorCode.QUOTA_EXCEEDED

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message, code=code, param=param, reason="key_quota",
                         retry_after_s=retry_after_s)


class WorkerLostError(CapacityError):
    """The worker's lease lapsed and it did not answer a probe: dead, hung or cut off (the
    router moves the request to another worker)."""

    code: str = ErrorCode.WORKER_LOST


class WorkerTimeoutError(PdserveError):
    """A worker sent nothing within a stage deadline (first token, next token): the request
    was given up, so the client may retry (HTTP 503 / UNAVAILABLE), never a 500."""

    code: str = ErrorCode.DECODE_TIMEOUT


class EngineClosedError(PdserveError):
    """The AsyncEngine is not running (stopping, or its thread died): the worker is going
    away, so the caller goes elsewhere (reported as a CapacityError: UNAVAILABLE / 503)."""

    code: str = ErrorCode.ENGINE_CLOSED


class RequestAbortedError(PdserveError):
    code: str = ErrorCode.ABORTED


class ModelLoadError(PdserveError):
    code: str = ErrorCode.MODEL_LOAD_ERROR


class UnsupportedArchitectureError(ModelLoadError):
    code: str = ErrorCode.UNSUPPORTED_ARCHITECTURE


class KVTransferError(PdserveError):
    code: str = ErrorCode.KV_TRANSFER_ERROR


class RemotePrefillFailed(PdserveError):
    """A remote prefill failed before its first token (router.remote): the router prefills
    the request locally instead."""

    code: str = ErrorCode.REMOTE_PREFILL_FAILED


class ControlPlaneError(PdserveError):
    """Redis is unreachable, too slow, or holds records we cannot read."""

    code: str = ErrorCode.CONTROL_PLANE_UNAVAILABLE


# --------------------------------------------------------------------------- the mapping


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
# CapacityError(code=ErrorCode.KV_PENDING_LIMIT)) keep their class through the status on
# the wire.
ERROR_CLASSES: dict[str, type[PdserveError]] = {
    PdserveError.code: PdserveError,
    InvalidRequestError.code: InvalidRequestError,
    PromptTooLongError.code: PromptTooLongError,
    CapacityError.code: CapacityError,
    RequestAbortedError.code: RequestAbortedError,
    KVTransferError.code: KVTransferError,
    ModelLoadError.code: ModelLoadError,
    UnsupportedArchitectureError.code: UnsupportedArchitectureError,
    # EngineClosedError: the worker is stopping, so the caller should go elsewhere.
    ErrorCode.ENGINE_CLOSED: CapacityError,
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
    """The stable code `exc` is reported with, as the plain string that goes on the wire."""
    if isinstance(exc, PdserveError):
        return str(exc.code)
    if isinstance(exc, TimeoutError):
        return str(ErrorCode.TIMEOUT)
    if isinstance(exc, NotImplementedError):
        return str(ErrorCode.UNIMPLEMENTED)
    return str(PdserveError.code)


def rebuild(kind: ErrorKind, code: str | None, message: str,
            param: str | None = None) -> PdserveError | TimeoutError:
    """The exception a caller raises for an error received as (`kind`, `code`): the code's
    registered class, else the kind's; DEADLINE_EXCEEDED is a TimeoutError. The code is
    kept as sent (one a newer peer added included)."""
    if kind is ErrorKind.DEADLINE_EXCEEDED:
        return TimeoutError(message)
    cls = ERROR_CLASSES.get(code or "") or _CLASS_BY_KIND.get(kind, PdserveError)
    return cls(message, code=code or cls.code, param=param)


__all__ = ["ERROR_CLASSES", "CapacityError", "ControlPlaneError", "EngineClosedError",
           "ErrorCode", "ErrorKind", "InvalidRequestError", "KVTransferError", "ModelLoadError",
           "OverloadedError", "PdserveError", "PromptTooLongError", "QuotaExceededError",
           "RemotePrefillFailed", "RequestAbortedError", "UnsupportedArchitectureError",
           "WorkerLostError", "WorkerTimeoutError", "code_of", "kind_of", "rebuild"]
