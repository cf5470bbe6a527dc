"""OpenAI request bodies: pydantic models, plus the fields we refuse rather than ignore.

Bodies are parsed strictly (no "16" for 16) and unknown fields are errors, so a client never
believes a setting took effect when it did not.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import APIError, bad_request

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None  # extension; -1 or 0 disables
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    user: str | None = None  # accepted and ignored
    latency_class: str | None = None  # extension; the X-Latency-Class header also sets it


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def _is(*neutral: object) -> Callable[[Any], bool]:
    return lambda v: any(v == n and type(v) is type(n) for n in neutral) or v is None


# Fields from OpenAI's API we do not implement: accepted only at their no-op value.
_UNSUPPORTED_COMMON: dict[str, Callable[[Any], bool]] = {
    "n": _is(1),
    "logit_bias": _is({}),
    "presence_penalty": _is(0, 0.0),
    "frequency_penalty": _is(0, 0.0),
}
UNSUPPORTED_COMPLETION = {
    **_UNSUPPORTED_COMMON,
    "best_of": _is(1),
    "echo": _is(False),
    "suffix": _is(""),
}
UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_COMMON,
    "tools": _is([]),
    "tool_choice": _is("none"),
    "functions": _is([]),
    "function_call": _is("none"),
    "parallel_tool_calls": _is(),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _is(),
    "prediction": _is(),
    "reasoning_effort": _is(),
    "web_search_options": _is(),
    "store": _is(False),
    "metadata": _is({}),
    "service_tier": _is("auto", "default"),
}

M = TypeVar("M", bound=BaseModel)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}",
                          code="invalid_json")
    return body


def validate(body: dict[str, Any], model: type[M],
             unsupported: Mapping[str, Callable[[Any], bool]]) -> M:
    """Check `body` against `model`, refusing unsupported fields by name (400)."""
    for name, neutral in unsupported.items():
        if name in body:
            if not neutral(body[name]):
                what = "only n=1 is supported" if name == "n" else f"'{name}' is not supported"
                raise bad_request(f"{what} by this server", param=name,
                                  code="unsupported_parameter")
            body = {k: v for k, v in body.items() if k != name}
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _from_validation(exc) from None


def _from_validation(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    # For a union, a value failing one member's type check is expected; a constraint
    # violation of the member that matched the type says what is actually wrong.
    err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    # loc may hold union member names ("prompt", "list[int]", 0): the field is what matters.
    param = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "extra_forbidden":
        return bad_request(f"unrecognized request argument: {param}", param=param,
                           code="unknown_parameter")
    if err["type"] == "missing":
        return bad_request(f"missing required argument: {param}", param=param,
                           code="missing_parameter")
    # Union errors repeat per member type; the first tells the client enough.
    return bad_request(f"invalid value for {param}: {err['msg']}", param=param,
                       code="invalid_type" if err["type"].endswith("_type") else "invalid_value")
