"""OpenAI request bodies: pydantic models, plus the fields we refuse rather than ignore.

Known fields are parsed strictly (no "16" for 16). Unknown fields are ignored with a debug log,
as vLLM does, so the load tools' vendor extensions (`max_completion_tokens` on completions,
`nvext`, ...) do not fail every request. Fields of OpenAI's API whose semantics we do not
implement (tools, functions, audio, ...) are refused by name unless at their no-op value, so
a client never believes such a setting took effect when it did not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import from_json

from pdserve.gateway.errors import APIError, bad_request
from pdserve.types import MAX_N, MAX_STOP_STRINGS

log = structlog.get_logger(__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="send a last chunk carrying `usage`")
    continuous_usage_stats: bool = Field(False, description="extension (vLLM): every chunk "
                                         "carries `usage` so far")


class JSONSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class OutputFormat(_Strict):
    """The `response_format` field."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


# Limits that depend on the served model (max_tokens, token ids) and those SamplingParams
# enforces are added to the published schema by gateway.openapi, from the same constants.
class _Common(_Strict):
    model: str | None = Field(None, description="the served model's id or an alias; "
                              "omitted: the served model")
    max_tokens: int | None = Field(None, description="most tokens to generate; prompt tokens + "
                                   "max_tokens must not exceed the context (max_model_len); "
                                   "omitted: default_max_tokens, clamped to the context left")
    temperature: float | None = Field(None, description="0 is greedy; omitted: 1.0")
    top_p: float | None = Field(None, description="nucleus sampling mass; omitted: 1.0 (off)")
    top_k: int | None = Field(None, description="extension: keep the k most likely tokens; "
                              "-1 or 0 disables")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX,
                             description="per-request sampling seed")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="stop strings, not included in the output")
    stream: bool = Field(False, description="stream chunks as server-sent events")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    ignore_eos: bool = Field(False, description="extension: keep generating past EOS")
    n: int = Field(1, ge=1, le=MAX_N, description="choices to return per prompt")
    presence_penalty: float = Field(0.0, description="subtracted from the logit of every token "
                                    "already in the output")
    frequency_penalty: float = Field(0.0, description="subtracted once per occurrence in the "
                                     "output")
    repetition_penalty: float = Field(1.0, description="extension (vLLM): > 1 discourages "
                                      "tokens of the prompt and output; 1 is off")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> "
                                                "bias in [-100, 100] added to its logit")
    min_p: float = Field(0.0, description="extension: drop tokens below min_p times the top "
                         "token's probability")
    min_tokens: int = Field(0, ge=0, description="extension: EOS and stop_token_ids cannot "
                            "end the output before this many tokens")
    stop_token_ids: list[int] | None = Field(None, description="extension: token ids that end "
                                             "the output")
    include_stop_str_in_output: bool = Field(False, description="extension: keep the stop "
                                             "string that ended the output")
    skip_special_tokens: bool = Field(True, description="extension: leave special tokens out "
                                      "of the text")
    response_format: OutputFormat | None = Field(
        None, description="`text`, `json_object` (any JSON object) or `json_schema` "
        "(`json_schema.schema` is the schema the output must match)")
    user: str | None = Field(None, description="accepted and ignored")
    latency_class: str | None = Field(None, description="extension: scheduling priority; the "
                                      "X-Latency-Class header also sets it (they must agree)")


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string, token ids, or a batch (list) of either; choice `index` is "
        "prompt index * n + sample index")
    logprobs: int | None = Field(None, description="return the log probability of each token "
                                 "and of this many alternatives")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="generate this many per "
                                "prompt (>= n) and return the n with the highest cumulative "
                                "logprob; not with stream")
    echo: bool = Field(False, description="prepend the prompt to each choice's text")


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(description="the conversation, oldest turn first, "
                                           "rendered with the model's chat template")
    max_completion_tokens: int | None = Field(None, description="same as max_tokens (send one, "
                                              "or both equal)")
    logprobs: bool = Field(False, description="return the log probability of each token")
    top_logprobs: int | None = Field(None, description="with logprobs: alternatives per token")


class Neutral:
    """Accepts None or one of ``values`` with the same type (``0`` does not stand for ``False``).
    The values are also what the OpenAPI schema lists for the field."""

    def __init__(self, *values: object):
        self.values = values

    def __call__(self, v: Any) -> bool:
        return v is None or any(v == n and type(v) is type(n) for n in self.values)


# Fields from OpenAI's API we do not implement: accepted only at their no-op value.
UNSUPPORTED_COMPLETION = {
    "suffix": Neutral(""),
}
UNSUPPORTED_CHAT = {
    "tools": Neutral([]),
    "tool_choice": Neutral("none"),
    "functions": Neutral([]),
    "function_call": Neutral("none"),
    "parallel_tool_calls": Neutral(),
    "modalities": Neutral(["text"]),
    "audio": Neutral(),
    "prediction": Neutral(),
    "reasoning_effort": Neutral(),
    "web_search_options": Neutral(),
    "store": Neutral(False),
    "metadata": Neutral({}),
    "service_tier": Neutral("auto", "default"),
}

M = TypeVar("M", bound=BaseModel)


# What the JSON parser itself refuses, whatever the configuration (pydantic_core's parser is
# iterative in Rust and stops here, so no body can exhaust the Python stack).
PARSER_MAX_DEPTH = 200


def parse_json_object(raw: bytes, max_depth: int = 32) -> dict[str, Any]:
    """The body as a JSON object, nested at most ``max_depth`` levels (the object itself is
    level 1); anything else is a 400 ``invalid_json`` / ``json_too_deep``. Strict RFC 8259:
    no NaN or Infinity literals, no lone surrogates."""
    try:
        body = from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        if "recursion limit" in str(exc):
            raise _too_deep(max_depth) from None
        raise bad_request(f"the request body is not valid JSON: {exc}",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}",
                          code="invalid_json")
    if json_depth(body) > max_depth:
        raise _too_deep(max_depth)
    return body


def _too_deep(max_depth: int) -> APIError:
    return bad_request(f"the request body is nested deeper than {max_depth} levels",
                       code="json_too_deep")


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
                                  code="unsupported_parameter")
            body = {k: v for k, v in body.items() if k != name}
    ignored = sorted(k for k in body if k not in model.model_fields)
    if ignored:
        log.debug("ignoring unknown request fields", fields=[k[:64] for k in ignored[:32]])
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
