"""One error table (pdserve.errors) for both APIs: every error maps the same way over gRPC
and over HTTP, and a client rebuilds the class the server raised."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.async_engine import EngineClosedError
from pdserve.errors import ERROR_CLASSES, ErrorKind, kind_of, rebuild
from pdserve.gateway.errors import from_pdserve
from pdserve.rpc.errors import status_for
from pdserve.types import (
    CapacityError,
    InvalidRequestError,
    KVTransferError,
    ModelLoadError,
    PdserveError,
    PromptTooLongError,
    RequestAbortedError,
)

# (exception, gRPC status, HTTP status)
CASES = [
    (InvalidRequestError("bad", param="prompt"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (PromptTooLongError("too long"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (CapacityError("busy"), grpc.StatusCode.UNAVAILABLE, 503),
    (CapacityError("pinned", code="kv_pending_limit"), grpc.StatusCode.UNAVAILABLE, 503),
    (EngineClosedError("engine is not running"), grpc.StatusCode.UNAVAILABLE, 503),
    (RequestAbortedError("aborted"), grpc.StatusCode.CANCELLED, 503),
    (KVTransferError("peer gone"), grpc.StatusCode.ABORTED, 500),
    (ModelLoadError("no weights"), grpc.StatusCode.INTERNAL, 500),
    # A stage timeout is retryable, never a 500 (issue 11).
    (PdserveError("decode worker sent nothing", code="decode_timeout"),
     grpc.StatusCode.UNAVAILABLE, 503),
]


@pytest.mark.parametrize(("exc", "status", "http"), CASES, ids=lambda c: getattr(c, "code", ""))
def test_every_error_maps_the_same_way_on_both_apis(exc: PdserveError, status: grpc.StatusCode,
                                                     http: int) -> None:
    assert status_for(exc)[0] == status
    api = from_pdserve(exc, retry_after_s=1)
    assert api.status == http and api.code == exc.code
    assert (http == 503) == ("Retry-After" in api.headers)
    kind = kind_of(exc)
    assert (kind.grpc_status_name, kind.http_status) == (status.name, http)


def test_registry_is_explicit_and_rebuilds_the_class() -> None:
    for code, cls in ERROR_CLASSES.items():
        assert issubclass(cls, PdserveError)
        assert cls.code == code or code == "engine_closed"
        rebuilt = rebuild(kind_of(cls("m")), code, "m", "p")
        assert type(rebuilt) is cls and rebuilt.code == code and rebuilt.param == "p"
    # A subclass defined elsewhere is not found by walking __subclasses__(): only the table
    # names classes, so a client never depends on what happens to be imported.
    class Local(CapacityError):
        code = "local_only"

    assert "local_only" not in ERROR_CLASSES
    assert type(rebuild(ErrorKind.UNAVAILABLE, "local_only", "m")) is CapacityError
    assert type(rebuild(ErrorKind.DEADLINE_EXCEEDED, "timeout", "m")) is TimeoutError
