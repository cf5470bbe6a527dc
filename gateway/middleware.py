"""Per-request context for every route: request id, API key check, structlog binding.

A plain ASGI middleware (not BaseHTTPMiddleware), so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
import uuid

import structlog
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, bad_request

REQUEST_ID_SCOPE_KEY = "pdserve.request_id"
_MAX_REQUEST_ID_LEN = 256
_OPEN_PATHS = frozenset({"/health"})


def request_id_of(scope: Scope) -> str:
    return str(scope[REQUEST_ID_SCOPE_KEY])


def _new_request_id(path: str) -> str:
    prefix = "chatcmpl" if path.endswith("/chat/completions") else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


def _valid_request_id(rid: str) -> bool:
    return 0 < len(rid) <= _MAX_REQUEST_ID_LEN and rid.isascii() and rid.isprintable()


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, api_keys: frozenset[str] = frozenset()):
        self.app = app
        self._keys = [k.encode() for k in api_keys]

    def _authorized(self, headers: Headers) -> APIError | None:
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        given = token.strip().encode()
        # Compare against every key so timing does not reveal which one nearly matched.
        if not any([hmac.compare_digest(given, k) for k in self._keys]):
            return APIError(401, "incorrect API key provided", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get("x-request-id")
        rid = given.strip() if given is not None else _new_request_id(scope["path"])
        error = None
        if not _valid_request_id(rid):
            error = bad_request(f"X-Request-Id must be 1-{_MAX_REQUEST_ID_LEN} printable ASCII "
                                "characters", param="X-Request-Id", code="invalid_request_id")
            rid = _new_request_id(scope["path"])
        scope[REQUEST_ID_SCOPE_KEY] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", rid)
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=rid):
            if error is None and self._keys and scope["path"] not in _OPEN_PATHS:
                error = self._authorized(headers)
            if error is not None:
                await error.response()(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)
