"""Per-request context for every route: request id, API key check (the caller's tenant, put in
the scope for the routes: `tenant_of`), structlog binding, and
the last line of defence: an exception no handler caught becomes an OpenAI-shaped 500 and one
structured log line, never a text/plain traceback.

A plain ASGI middleware (not BaseHTTPMiddleware), so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import uuid

import structlog
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.errors import ErrorCode, InvalidRequestError
from pdserve.gateway.errors import APIError, bad_request, internal
from pdserve.tenants import OPEN, Tenant, Tenants
from pdserve.types import MAX_REQUEST_ID_LEN, check_request_id

log = structlog.get_logger(__name__)

REQUEST_ID_SCOPE_KEY = "pdserve.request_id"
TENANT_SCOPE_KEY = "pdserve.tenant"
# Readable without an API key: liveness, and the API's contract (not a secret).
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
METRICS_PATH = "/metrics"  # open too unless the gateway is configured otherwise


def request_id_of(scope: Scope) -> str:
    return str(scope[REQUEST_ID_SCOPE_KEY])


def tenant_of(scope: Scope) -> Tenant:
    """The caller of a request that passed the key check (`OPEN` on an open path)."""
    tenant = scope.get(TENANT_SCOPE_KEY, OPEN)
    assert isinstance(tenant, Tenant)
    return tenant


def _new_request_id(path: str) -> str:
    prefix = "chatcmpl" if path.endswith("/chat/completions") else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


def _valid_request_id(rid: str) -> bool:
    try:
        check_request_id(rid)
    except InvalidRequestError:
        return False
    return True


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, tenants: Tenants | None = None, *,
                 open_paths: frozenset[str] = OPEN_PATHS | {METRICS_PATH}):
        self.app = app
        self._tenants = tenants if tenants is not None else Tenants()
        self._open_paths = open_paths

    def _authorized(self, headers: Headers) -> Tenant | APIError:
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                            code=ErrorCode.INVALID_API_KEY, headers={"WWW-Authenticate": "Bearer"})
        tenant = self._tenants.identify(token.strip())
        if tenant is None:
            return APIError(401, "incorrect API key provided", code=ErrorCode.INVALID_API_KEY,
                            headers={"WWW-Authenticate": "Bearer"})
        return tenant

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get("x-request-id")
        rid = given.strip() if given is not None else _new_request_id(scope["path"])
        error = None
        if not _valid_request_id(rid):
            error = bad_request(f"X-Request-Id must be 1-{MAX_REQUEST_ID_LEN} printable ASCII "
                                "characters", param="X-Request-Id",
                                code=ErrorCode.INVALID_REQUEST_ID)
            rid = _new_request_id(scope["path"])
        scope[REQUEST_ID_SCOPE_KEY] = rid

        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message).append("X-Request-Id", rid)
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=rid):
            if error is None and self._tenants.enabled and scope["path"] not in self._open_paths:
                found = self._authorized(headers)
                if isinstance(found, APIError):
                    error = found
                else:
                    scope[TENANT_SCOPE_KEY] = found
            if error is not None:
                await error.response()(scope, receive, send_with_id)
                return
            try:
                await self.app(scope, receive, send_with_id)
            except Exception as exc:
                # A bug, not a client mistake: one JSON log line with the traceback; the client
                # gets an OpenAI error object (or, mid-response, a closed connection).
                log.error("unhandled error", path=scope["path"], exc_info=exc)
                if not started:
                    await internal().response()(scope, receive, send_with_id)
