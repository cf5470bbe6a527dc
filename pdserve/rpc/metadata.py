"""Call metadata: the `x-request-id` that follows a request from gateway to every worker."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from pdserve.errors import InvalidRequestError
from pdserve.types import check_request_id

REQUEST_ID_KEY = "x-request-id"  # invocation metadata; echoed in error trailers


def metadata_value(metadata: Iterable[tuple[str, Any]] | None, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def invalid_request_id(request_id: str) -> bool:
    try:
        check_request_id(request_id)
    except InvalidRequestError:
        return True
    return False


def request_id_metadata(
    request_id: str, metadata: Iterable[tuple[str, str]] = ()
) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `x-request-id` (plus any other pairs given)."""
    return (*((k, v) for k, v in metadata if k != REQUEST_ID_KEY), (REQUEST_ID_KEY, request_id))


def request_id_from_context(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's `x-request-id`, if it sent a valid one (servers built with `new_server`
    refuse calls carrying an invalid one)."""
    rid = metadata_value(context.invocation_metadata(), REQUEST_ID_KEY)
    return None if rid is None or invalid_request_id(rid) else rid
