"""The OpenAI-compatible REST gateway over a `GenerationBackend`: routes, middleware and error
handlers.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming or not: `gateway.serving`),
GET /v1/models, GET /health, GET /metrics, and GET /v1/pdserve/workers when the backend lists
workers (admin keys only when keys are set); the OpenAPI schema of exactly these at
/openapi.json (browsable at /docs and /redoc), generated from the protocol models the
responses are built with. Every error is an OpenAI error object with a meaningful status.

Each API key is a tenant (`pdserve.tenants`): the backend sees request ids namespaced by the
caller's key (responses echo the client's own), each key's requests in flight are bounded
and its latency class capped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.engine.metrics import MODEL_LABEL, exposition, labelled_registry
from pdserve.errors import ErrorCode
from pdserve.gateway.backend import GenerationBackend, ListsWorkers
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import PERMISSION, SERVER_ERROR, APIError, bad_request
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.middleware import (
    METRICS_PATH,
    OPEN_PATHS,
    RequestContextMiddleware,
    tenant_of,
)
from pdserve.gateway.openapi import ROUTE_DOCS, install_openapi
from pdserve.gateway.protocol import Health, ModelCard, ModelList, WorkerList
from pdserve.gateway.serving import Serving
from pdserve.gateway.translate import Translator
from pdserve.tenants import Tenants

__all__ = ["GatewayConfig", "create_app"]

_ROLES = ("prefill", "decode")


def create_app(backend: GenerationBackend, config: GatewayConfig | None = None, *,
               tenants: Tenants | None = None) -> FastAPI:
    """Build the gateway app. Its metrics go into `backend.metrics_registry`, so build at
    most one app per backend (registering twice raises ValueError). `tenants`: the callers
    and their requests in flight, when shared with another API (the router's gRPC one);
    by default the config's keys, counted here alone."""
    config = config or GatewayConfig()
    if tenants is None:
        tenants = Tenants(config.api_keys, config.key_policies)
    routes_of = _Routes(backend, config, tenants)
    app = FastAPI(title="pdserve", docs_url="/docs", redoc_url="/redoc",
                  openapi_url="/openapi.json")
    open_paths = OPEN_PATHS if config.metrics_require_auth else OPEN_PATHS | {METRICS_PATH}
    app.add_middleware(RequestContextMiddleware, tenants=tenants, open_paths=open_paths)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    routes: list[tuple[str, Callable[..., Any], str]] = [
        ("/v1/completions", routes_of.completions, "POST"),
        ("/v1/chat/completions", routes_of.chat_completions, "POST"),
        ("/v1/models", routes_of.models, "GET"),
        ("/v1/models/{model:path}", routes_of.model, "GET"),
        ("/health", routes_of.health, "GET"),
        ("/metrics", routes_of.metrics_page, "GET")]
    if isinstance(backend, ListsWorkers):  # else the route does not exist (404, not in the schema)
        routes.append(("/v1/pdserve/workers", routes_of.workers, "GET"))
    for path, endpoint, method in routes:
        # Handlers return their Response; response_model (in ROUTE_DOCS) documents it.
        app.add_api_route(path, endpoint, methods=[method], **ROUTE_DOCS[path])
    install_openapi(app, config, max_model_len=backend.max_model_len,
                    vocab_size=backend.tokenizer.vocab_size)
    return app


class _Routes:
    def __init__(self, backend: GenerationBackend, config: GatewayConfig, tenants: Tenants):
        self.backend = backend
        self.config = config
        model_name = config.served_model_name or backend.model_name
        self.translator = Translator(backend, config, model_name)
        registry = backend.metrics_registry
        self.serving = Serving(backend, config, GatewayMetrics(registry), tenants,
                               self.translator)
        self.metrics_page_registry = labelled_registry(registry, **{MODEL_LABEL: model_name})
        self.card = ModelCard(id=model_name, object="model", created=int(time.time()),
                              owned_by="pdserve", max_model_len=backend.max_model_len)

    async def completions(self, request: Request) -> Response:
        return await self.serving.generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self.serving.generate(request, "chat")

    async def models(self) -> JSONResponse:
        return JSONResponse(ModelList(object="list", data=[self.card]).body())

    async def model(self, model: str) -> JSONResponse:
        self.translator.check_model(model)
        return JSONResponse(self.card.body())

    async def health(self) -> JSONResponse:
        ok, reason = self.backend.ready()
        if not ok:
            return APIError(503, reason, type=SERVER_ERROR, code=ErrorCode.NOT_READY,
                            headers={"Retry-After": str(self.config.retry_after_s)}).response()
        return JSONResponse(Health(status="ok").body())

    async def workers(self, request: Request) -> JSONResponse:
        assert isinstance(self.backend, ListsWorkers)  # the route exists only then
        if not tenant_of(request.scope).policy.admin:  # internal addresses: operators only
            raise APIError(403, "listing workers needs an admin API key", type=PERMISSION,
                           code=ErrorCode.PERMISSION_DENIED)
        found = [w for role in _ROLES for w in self.backend.workers(role)]
        return JSONResponse(WorkerList(workers=[
            dataclasses.asdict(w) if dataclasses.is_dataclass(w) and not isinstance(w, type)
            else w for w in found]).body())

    async def metrics_page(self) -> Response:
        return Response(await exposition(self.metrics_page_registry),
                        media_type=CONTENT_TYPE_LATEST)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return APIError(404, f"no such route: {where}", code=ErrorCode.NOT_FOUND).response()
    if exc.status_code == 405:
        return APIError(405, f"method not allowed: {where}", code=ErrorCode.METHOD_NOT_ALLOWED,
                        headers=dict(exc.headers or {})).response()
    return APIError(exc.status_code, str(exc.detail), code=ErrorCode.HTTP_ERROR,
                    headers=dict(exc.headers or {})).response()


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    loc = errors[0].get("loc", ()) if errors else ()
    param = str(loc[-1]) if loc else None
    msg = errors[0].get("msg", "invalid request") if errors else "invalid request"
    return bad_request(f"invalid value for {param}: {msg}", param=param).response()
