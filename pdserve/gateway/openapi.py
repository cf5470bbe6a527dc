"""The gateway's OpenAPI contract, served at /openapi.json (and rendered at /docs, /redoc).

The document is generated from the code: FastAPI writes each route's responses from the
protocol models the handlers build them with (`response_model`), and the request bodies are
the protocol models' own schemas, sampling limits included (`gateway.protocol`). Request bodies
are parsed by hand (`gateway.body`, so a hostile body never reaches a recursive parser), hence
they are referenced here rather than inferred from the handlers' signatures. What is added here
depends on the running server: the served model's context and vocabulary, the request id
rule, the body size and JSON depth bounds, the API keys, the headers and common errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    WorkerList,
)
from pdserve.types import MAX_REQUEST_ID_LEN

_REF = "#/components/schemas/{model}"

# --------------------------------------------------------------------------- operations

_SSE = ("With `stream: true`, `text/event-stream`: `data: {chunk}` lines (`*.chunk` objects), "
        "an error object if the request fails after its first token, then `data: [DONE]`.")


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI 3.1 has an event stream's `schema` describe each event (3.2 calls it
    `itemSchema`): its data is a chunk or an error object (JSON), or ``[DONE]``."""
    return {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "description": "a JSON chunk or error object, or [DONE] (the last "
        "event)", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
            {"$ref": _REF.format(model=m.__name__)} for m in (chunk, ErrorResponse)]}}}}


def _generation(summary: str, body: type[BaseModel], result: type[BaseModel],
                chunk: type[BaseModel]) -> dict[str, Any]:
    return {
        "summary": summary,
        "response_model": result,
        "responses": {
            200: {"description": f"the completion. {_SSE}",
                  "content": {"text/event-stream": {"schema": _sse_event(chunk)}}},
            404: {"model": ErrorResponse, "description": "unknown model (`model_not_found`)"},
            413: {"model": ErrorResponse, "description": "body over max_body_bytes"},
            503: {"model": ErrorResponse,
                  "description": "no capacity or not ready; retry after `Retry-After` seconds"},
            504: {"model": ErrorResponse, "description": "not finished within the request "
                  "timeout"},
        },
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=body.__name__)}}}}},
    }


ROUTE_DOCS: dict[str, dict[str, Any]] = {
    "/v1/completions": _generation("Create a completion", CompletionRequest, Completion,
                                   CompletionChunk),
    "/v1/chat/completions": _generation("Create a chat completion", ChatCompletionRequest,
                                        ChatCompletion, ChatCompletionChunk),
    "/v1/models": {"summary": "List the served model", "response_model": ModelList,
                   "responses": {200: {"description": "the served model"}}},
    "/v1/models/{model:path}": {
        "summary": "Describe the served model", "response_model": ModelCard,
        "responses": {200: {"description": "the model"},
                      404: {"model": ErrorResponse, "description": "unknown model"}}},
    "/health": {"summary": "Readiness", "response_model": Health, "responses": {
        200: {"description": "a decode worker can take requests"},
        503: {"model": ErrorResponse, "description": "not ready (`not_ready`)"}}},
    "/metrics": {"summary": "Prometheus metrics", "response_model": None, "responses": {200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}}}}},
    "/v1/pdserve/workers": {
        "summary": "The router's worker directory (admin keys only)",
        "response_model": WorkerList,
        "responses": {200: {"description": "registered workers"},
                      403: {"model": ErrorResponse, "description": "not an admin key"}}},
}

# --------------------------------------------------------------------------- the schema


def install_openapi(app: FastAPI, config: GatewayConfig, *, max_model_len: int,
                    vocab_size: int) -> None:
    """Make `app.openapi()` (what /openapi.json serves) build the full contract once."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title="pdserve", version="1", routes=app.routes,
                                 description=_description(config))
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                body = model.model_json_schema(ref_template=_REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            for event in (CompletionChunk, ChatCompletionChunk, ErrorResponse):  # SSE events
                body = event.model_json_schema(ref_template=_REF, mode="serialization")
                for name, found in (*body.pop("$defs", {}).items(), (event.__name__, body)):
                    components.setdefault(name, found)
            _served_bounds(components, max_model_len, vocab_size)
            _add_common(schema, config)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]


def _description(config: GatewayConfig) -> str:
    return ("OpenAI-compatible API of pdserve. Limits: request bodies of at most "
            f"{config.max_body_bytes} bytes (else 413), JSON nested at most "
            f"{config.max_json_depth} levels (else 400 `json_too_deep`), prompt tokens plus "
            "max_tokens within the model's context (else 400 `context_length_exceeded`), "
            f"X-Request-Id of 1-{MAX_REQUEST_ID_LEN} printable ASCII characters. "
            "Every error is an OpenAI error object.")


def _served_bounds(components: dict[str, Any], max_model_len: int, vocab_size: int) -> None:
    """The served model's limits: max_tokens below the context, prompt token ids below the
    vocabulary size."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = components[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            for member in props.get(field, {}).get("anyOf", []):
                if member.get("type") == "integer":
                    member["maximum"] = max_model_len - 1
    stack = [components["CompletionRequest"]["properties"]["prompt"]]
    while stack:
        node = stack.pop()
        if node.get("type") == "integer":
            node["maximum"] = vocab_size - 1
        stack.extend(node.get("anyOf", []))
        if isinstance(node.get("items"), dict):
            stack.append(node["items"])


def _header(name: str, description: str, **schema: Any) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": False, "description": description,
            "schema": {"type": "string", **schema}}


_REQUEST_ID = _header(
    "X-Request-Id", "the request's id (else one is generated); echoed back and logged",
    minLength=1, maxLength=MAX_REQUEST_ID_LEN, pattern="^[ -~]+$")
_GENERATION_HEADERS = [
    _header("X-Latency-Class", "scheduling priority", enum=["interactive", "standard", "batch"]),
    _header("X-Pdserve-Timings", "1: return the route and stage timings"),
]
_ERROR_REF = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}


def _add_common(schema: dict[str, Any], config: GatewayConfig) -> None:
    """Headers and errors every route has: X-Request-Id (400 when invalid), 500, and with API
    keys the bearer scheme and 401 on every route but /health."""
    components = schema["components"]
    if config.api_keys:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    errors: dict[str, tuple[str, Callable[[str], bool]]] = {
        "400": ("invalid request: malformed or too deeply nested JSON, an invalid field or "
                "header, or a prompt that does not fit the context", lambda _: True),
        "500": ("internal error (a failed generation: `engine_error`)", lambda _: True),
        "401": ("missing or wrong API key",
                lambda path: bool(config.api_keys) and path != "/health"),
    }
    for path, item in schema["paths"].items():
        for method, op in item.items():
            op["responses"].pop("422", None)  # FastAPI's default; our validation errors are 400
            op.setdefault("parameters", []).append(_REQUEST_ID)
            if method == "post":
                op["parameters"].extend(_GENERATION_HEADERS)
            for status, (description, applies) in errors.items():
                if applies(path):
                    op["responses"].setdefault(status, {"description": description,
                                                        "content": _ERROR_REF})
            open_path = path == "/health" or (path == "/metrics"
                                              and not config.metrics_require_auth)
            if config.api_keys and not open_path:
                op["security"] = [{"bearer": []}]
    for unused in ("HTTPValidationError", "ValidationError"):
        components["schemas"].pop(unused, None)
