"""A request body, from bytes to a validated protocol model: bounded in size (413) and in JSON
nesting (400, checked without recursion, so a hostile body never reaches a recursive parser),
then checked against its model (`gateway.protocol`), refusing unsupported fields by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import structlog
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from starlette.requests import Request

from pdserve.errors import ErrorCode
from pdserve.gateway.errors import APIError, bad_request
from pdserve.gateway.protocol import Neutral

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=BaseModel)

# What the JSON parser itself refuses, whatever the configuration (pydantic_core's parser is
# iterative in Rust and stops here, so no body can exhaust the Python stack).
PARSER_MAX_DEPTH = 200


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    too_large = APIError(413, f"the request body exceeds {limit} bytes",
                         code=ErrorCode.REQUEST_TOO_LARGE)
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(raw: bytes, max_depth: int = 32) -> dict[str, Any]:
    """The body as a JSON object, nested at most ``max_depth`` levels (the object itself is
    level 1); anything else is a 400 ``invalid_json`` / ``json_too_deep``. Strict RFC 8259:
    no NaN or Infinity literals, no lone surrogates."""
    try:
        body = from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        if "recursion limit" in str(exc):
            raise _too_deep(max_depth) from exc
        raise bad_request(f"the request body is not valid JSON: {exc}",
                          code=ErrorCode.INVALID_JSON) from exc
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}",
                          code=ErrorCode.INVALID_JSON)
    if json_depth(body) > max_depth:
        raise _too_deep(max_depth)
    return body


def _too_deep(max_depth: int) -> APIError:
    return bad_request(f"the request body is nested deeper than {max_depth} levels",
                       code=ErrorCode.JSON_TOO_DEEP)


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, ``[]`` is 1), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


def validate(body: dict[str, Any], model: type[M], unsupported: Mapping[str, Neutral]) -> M:
    """Check `body` against `model`, refusing unsupported fields by name (400) and ignoring
    unknown ones (logged at debug level, as vLLM does)."""
    for name, neutral in unsupported.items():
        if name in body:
            if not neutral(body[name]):
                raise bad_request(f"'{name}' is not supported by this server", param=name,
                                  code=ErrorCode.UNSUPPORTED_PARAMETER)
            body = {k: v for k, v in body.items() if k != name}
    ignored = sorted(k for k in body if k not in model.model_fields)
    if ignored:
        log.debug("ignoring unknown request fields", fields=[k[:64] for k in ignored[:32]])
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _from_validation(exc) from exc


def _from_validation(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    # For a union, a value failing one member's type check is expected; a constraint
    # violation of the member that matched the type says what is actually wrong.
    err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    # loc may hold union member names ("prompt", "list[int]", 0): the field is what matters.
    param = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "extra_forbidden":
        return bad_request(f"unrecognized request argument: {param}", param=param,
                           code=ErrorCode.UNKNOWN_PARAMETER)
    if err["type"] == "missing":
        return bad_request(f"missing required argument: {param}", param=param,
                           code=ErrorCode.MISSING_PARAMETER)
    # Union errors repeat per member type; the first tells the client enough.
    return bad_request(f"invalid value for {param}: {err['msg']}", param=param,
                       code=ErrorCode.INVALID_TYPE if err["type"].endswith("_type")
                       else ErrorCode.INVALID_VALUE)
