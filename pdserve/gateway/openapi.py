"""The gateway's OpenAPI contract, served at /openapi.json (and rendered at /docs, /redoc).

The schema states the server's own limits, taken from the constants and the configuration
that enforce them: the served model's context and vocabulary, `engine.types`' sampling limits,
the request id rule, the body size and JSON depth bounds. Request bodies are parsed by hand
(`gateway.schemas`, so a hostile body never reaches a recursive parser), hence their schemas are
added here rather than inferred by FastAPI from the handlers' signatures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from pdserve.engine.tokenizer import CHAT_ROLES
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.schemas import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    Neutral,
)
from pdserve.types import MAX_LOGPROBS, MAX_REQUEST_ID_LEN, MAX_TEMPERATURE

# --------------------------------------------------------------------------- response bodies


class ErrorBody(BaseModel):
    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, whatever the status: an OpenAI error object."""

    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens found in the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PdserveInfo(BaseModel):
    """Where the request ran and where its time went (sent with X-Pdserve-Timings: 1)."""

    route: str | None = Field(description="local, remote or fallback")
    timings_ms: dict[str, float]


FinishReasonName = Literal["stop", "length"]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReasonName


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    pdserve: PdserveInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    pdserve: PdserveInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int = Field(description="the context: prompt plus output tokens")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class WorkerList(BaseModel):
    workers: list[dict[str, Any]] = Field(description="registered prefill and decode workers")


# --------------------------------------------------------------------------- operations

_SSE = ("With `stream: true`, `text/event-stream`: `data: {chunk}` lines (`*.chunk` objects), "
        "an error object if the request fails after its first token, then `data: [DONE]`.")
# OpenAPI 3.1 has an event stream's `schema` describe each event (3.2 calls it `itemSchema`).
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a JSON chunk or error object, or [DONE] (the last event)"}}}


def _generation(summary: str, body: type[BaseModel], result: type[BaseModel]) -> dict[str, Any]:
    return {
        "summary": summary,
        "responses": {
            200: {"model": result, "description": f"the completion. {_SSE}",
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
            404: {"model": ErrorResponse, "description": "unknown model (`model_not_found`)"},
            413: {"model": ErrorResponse, "description": "body over max_body_bytes"},
            503: {"model": ErrorResponse,
                  "description": "no capacity or not ready; retry after `Retry-After` seconds"},
            504: {"model": ErrorResponse, "description": "not finished within the request "
                  "timeout"},
        },
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}},
    }


ROUTE_DOCS: dict[str, dict[str, Any]] = {
    "/v1/completions": _generation("Create a completion", CompletionRequest, Completion),
    "/v1/chat/completions": _generation("Create a chat completion", ChatCompletionRequest,
                                        ChatCompletion),
    "/v1/models": {"summary": "List the served model",
                   "responses": {200: {"model": ModelList, "description": "the served model"}}},
    "/v1/models/{model:path}": {
        "summary": "Describe the served model",
        "responses": {200: {"model": ModelCard, "description": "the model"},
                      404: {"model": ErrorResponse, "description": "unknown model"}}},
    "/health": {"summary": "Readiness", "responses": {
        200: {"model": Health, "description": "a decode worker can take requests"},
        503: {"model": ErrorResponse, "description": "not ready (`not_ready`)"}}},
    "/metrics": {"summary": "Prometheus metrics", "responses": {200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}}}}},
    "/v1/pdserve/workers": {
        "summary": "The router's worker directory (admin keys only)",
        "responses": {200: {"model": WorkerList, "description": "registered workers"},
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
            _add_request_bodies(schema, max_model_len, vocab_size)
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


def _add_request_bodies(schema: dict[str, Any], max_model_len: int, vocab_size: int) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    for model, unsupported, patch in (
            (CompletionRequest, UNSUPPORTED_COMPLETION, lambda p: _completion(p, token_id)),
            (ChatCompletionRequest, UNSUPPORTED_CHAT, _chat)):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        props = body["properties"]
        _sampling(props, max_model_len)
        patch(props)
        for name, neutral in unsupported.items():
            props[name] = _neutral(name, neutral)
        components[model.__name__] = body


def _bound(prop: dict[str, Any], **limits: Any) -> None:
    """Add `limits` to the non-null member(s) of an optional property."""
    for member in prop.get("anyOf", [prop]):
        if member.get("type") != "null":
            member.update(limits)


def _sampling(props: dict[str, Any], max_model_len: int) -> None:
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:
            _bound(props[name], minimum=1, maximum=max_model_len - 1)
    _bound(props["temperature"], minimum=0, maximum=MAX_TEMPERATURE)
    _bound(props["top_p"], exclusiveMinimum=0, maximum=1)
    _bound(props["top_k"], minimum=-1)
    for member in props["stop"]["anyOf"]:
        if member.get("type") == "string":
            member["minLength"] = 1
        elif member.get("type") == "array":
            member["items"]["minLength"] = 1
    _bound(props["latency_class"], enum=["interactive", "standard", "batch"])


def _completion(props: dict[str, Any], token_id: dict[str, Any]) -> None:
    _bound(props["logprobs"], minimum=0, maximum=MAX_LOGPROBS)
    props["prompt"] = {"description": props["prompt"].get("description", ""), "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": token_id, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": token_id, "minItems": 1},
         "minItems": 1}]}


def _chat(props: dict[str, Any]) -> None:
    _bound(props["top_logprobs"], minimum=0, maximum=MAX_LOGPROBS)
    text_part = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {
        "type": "object", "additionalProperties": False, "required": ["role", "content"],
        "properties": {
            "role": {"enum": sorted(CHAT_ROLES | {"developer"}),
                     "description": "developer is read as system"},
            "content": {"anyOf": [{"type": "string"},
                                  {"type": "array", "items": text_part}]},
            "name": {"type": "string", "description": "accepted and ignored"}}}
    props["messages"] = {"description": props["messages"].get("description", ""),
                         "type": "array", "items": message, "minItems": 1}


def _neutral(name: str, neutral: Neutral) -> dict[str, Any]:
    return {"enum": [*neutral.values, None],
            "description": f"not supported: `{name}` is accepted only at its no-op value"}


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
    error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components["schemas"].update(error.pop("$defs", {}))
    components["schemas"].setdefault("ErrorResponse", error)
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
