"""The OpenAI API's bodies as pydantic models, one type per body: requests are validated with
them, responses are built from them, and /openapi.json is generated from them
(`gateway.openapi` adds only what depends on the running server: its context, vocabulary,
keys and headers).

Requests: known fields are parsed strictly (no "16" for 16); unknown fields are ignored (as
vLLM does, so the load tools' vendor extensions do not fail every request); fields of OpenAI's
API we do not implement are refused by name unless at their no-op value (`UNSUPPORTED_*`), so
a client never believes such a setting took effect when it did not. Sampling limits are the
engine's own (`pdserve.types`): published here with `Limits`, enforced by `SamplingParams`, so
a request over one gets the same 400 `invalid_sampling_params` over REST as over gRPC.

Responses: a field is on the wire when its builder set it (`body()` dumps with
``exclude_unset``): required fields always, ``null`` included; optional ones (`usage` on a
chunk, `pdserve`) only where given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from pdserve.engine.tokenizer import CHAT_ROLES
from pdserve.types import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    LatencyClass,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Limits:
    """JSON-schema bounds of a value that the schema states and `SamplingParams` (or the
    server, for the context) enforces: they do not validate here."""

    def __init__(self, **bounds: Any):
        self.bounds = bounds

    def __get_pydantic_json_schema__(self, core_schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        schema = handler(core_schema)
        schema.update(self.bounds)
        return schema


class Body(BaseModel):
    def body(self) -> dict[str, Any]:
        """The JSON object sent: the fields its builder set (see the module's docstring)."""
        return self.model_dump(exclude_unset=True)


# --------------------------------------------------------------------------- requests


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


Penalty = Annotated[float, Limits(minimum=-MAX_PENALTY, maximum=MAX_PENALTY)]
NonEmpty = Annotated[str, Limits(minLength=1)]
# gateway.openapi adds the served model's bounds: max_tokens below the context, token ids
# below the vocabulary size.
TokenId = Annotated[int, Limits(minimum=0)]
MaxTokens = Annotated[int, Limits(minimum=1)]


class _Common(_Strict):
    model: str | None = Field(None, description="the served model's id or an alias; "
                              "omitted: the served model")
    max_tokens: MaxTokens | None = Field(
        None, description="most tokens to generate; prompt tokens + max_tokens must not "
        "exceed the context (max_model_len); omitted: default_max_tokens, clamped to the "
        "context left")
    temperature: Annotated[float, Limits(minimum=0, maximum=MAX_TEMPERATURE)] | None = Field(
        None, description="0 is greedy; omitted: 1.0")
    top_p: Annotated[float, Limits(exclusiveMinimum=0, maximum=1)] | None = Field(
        None, description="nucleus sampling mass; omitted: 1.0 (off)")
    top_k: Annotated[int, Limits(minimum=-1)] | None = Field(
        None, description="extension: keep the k most likely tokens; -1 or 0 disables")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX,
                             description="per-request sampling seed")
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)] | None = \
        Field(None, description="stop strings, not included in the output")
    stream: bool = Field(False, description="stream chunks as server-sent events")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    ignore_eos: bool = Field(False, description="extension: keep generating past EOS")
    n: int = Field(1, ge=1, le=MAX_N, description="choices to return per prompt")
    presence_penalty: Penalty = Field(0.0, description="subtracted from the logit of every "
                                      "token already in the output")
    frequency_penalty: Penalty = Field(0.0, description="subtracted once per occurrence in "
                                       "the output")
    repetition_penalty: Annotated[float, Limits(
        minimum=1 / MAX_REPETITION_PENALTY, maximum=MAX_REPETITION_PENALTY)] = Field(
        1.0, description="extension (vLLM): > 1 discourages tokens of the prompt and output; "
        "1 is off")
    logit_bias: Annotated[dict[str, Annotated[float, Limits(
        minimum=-MAX_LOGIT_BIAS_VALUE, maximum=MAX_LOGIT_BIAS_VALUE)]], Limits(
        maxProperties=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (as a string) -> bias added to its logit")
    min_p: Annotated[float, Limits(minimum=0, maximum=1)] = Field(
        0.0, description="extension: drop tokens below min_p times the top token's "
        "probability")
    min_tokens: int = Field(0, ge=0, description="extension: EOS and stop_token_ids cannot "
                            "end the output before this many tokens")
    stop_token_ids: list[TokenId] | None = Field(None, description="extension: token ids that "
                                                 "end the output")
    include_stop_str_in_output: bool = Field(False, description="extension: keep the stop "
                                             "string that ended the output")
    skip_special_tokens: bool = Field(True, description="extension: leave special tokens out "
                                      "of the text")
    response_format: OutputFormat | None = Field(
        None, description="`text`, `json_object` (any JSON object) or `json_schema` "
        "(`json_schema.schema` is the schema the output must match)")
    user: str | None = Field(None, description="accepted and ignored")
    latency_class: Annotated[str, Limits(enum=[c.value for c in LatencyClass])] | None = Field(
        None, description="extension: scheduling priority; the X-Latency-Class header also "
        "sets it (they must agree)")


class Neutral:
    """Accepts None or one of ``values`` with the same type (``0`` does not stand for ``False``).
    The values are also what the OpenAPI schema lists for the field."""

    def __init__(self, *values: object):
        self.values = values

    def __call__(self, v: Any) -> bool:
        return v is None or any(v == n and type(v) is type(n) for n in self.values)

    def schema(self, name: str) -> dict[str, Any]:
        return {"enum": [*self.values, None],
                "description": f"not supported: `{name}` is accepted only at its no-op value"}


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


def _with_unsupported(table: dict[str, Neutral]) -> Callable[[dict[str, Any]], None]:
    """The schema lists the unsupported fields too, each with its no-op values."""
    return lambda schema: schema["properties"].update(
        (name, n.schema(name)) for name, n in table.items())


class CompletionRequest(_Common):
    model_config = ConfigDict(json_schema_extra=_with_unsupported(UNSUPPORTED_COMPLETION))

    prompt: (NonEmpty | Annotated[list[TokenId], Limits(minItems=1)]
             | Annotated[list[NonEmpty], Limits(minItems=1)]
             | Annotated[list[Annotated[list[TokenId], Limits(minItems=1)]],
                         Limits(minItems=1)]) = Field(
        description="a string, token ids, or a batch (list) of either; choice `index` is "
        "prompt index * n + sample index")
    logprobs: Annotated[int, Limits(minimum=0, maximum=MAX_LOGPROBS)] | None = Field(
        None, description="return the log probability of each token and of this many "
        "alternatives")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="generate this many per "
                                "prompt (>= n) and return the n with the highest cumulative "
                                "logprob; not with stream")
    echo: bool = Field(False, description="prepend the prompt to each choice's text")


_TEXT_PART: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_MESSAGE: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["role", "content"],
    "properties": {
        "role": {"enum": sorted(CHAT_ROLES | {"developer"}),
                 "description": "developer is read as system"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
        "name": {"type": "string", "description": "accepted and ignored"}}}


class ChatCompletionRequest(_Common):
    model_config = ConfigDict(json_schema_extra=_with_unsupported(UNSUPPORTED_CHAT))

    # Checked message by message in translation (`gateway.translate`), which names the
    # offending part; the schema states the shape.
    messages: list[dict[str, Any]] = Field(
        description="the conversation, oldest turn first, rendered with the model's chat "
        "template", json_schema_extra={"items": _MESSAGE, "minItems": 1})
    max_completion_tokens: MaxTokens | None = Field(None, description="same as max_tokens "
                                                    "(send one, or both equal)")
    logprobs: bool = Field(False, description="return the log probability of each token")
    top_logprobs: Annotated[int, Limits(minimum=0, maximum=MAX_LOGPROBS)] | None = Field(
        None, description="with logprobs: alternatives per token")


# --------------------------------------------------------------------------- responses

ErrorType = Literal["invalid_request_error", "server_error", "rate_limit_error",
                    "permission_error"]


class ErrorBody(Body):
    message: str
    type: ErrorType
    param: str | None
    code: str | None


class ErrorResponse(Body):
    """Every error, whatever the status: an OpenAI error object."""

    error: ErrorBody


class PromptTokensDetails(Body):
    cached_tokens: int = Field(description="prompt tokens found in the prefix cache")


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PdserveInfo(Body):
    """Where the request ran and where its time went (sent with X-Pdserve-Timings: 1)."""

    route: str | None = Field(description="local, remote or fallback")
    timings_ms: dict[str, float]


FinishReasonName = Literal["stop", "length"]


class CompletionLogprobs(Body):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReasonName


class CompletionChunkChoice(Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReasonName | None


class Completion(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    pdserve: PdserveInfo | None = None


class CompletionChunk(Body):
    """A streamed piece of a completion; the last one may carry only `usage` (no choices)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    pdserve: PdserveInfo | None = None


class TopLogprob(Body):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Body):
    content: list[ChatTokenLogprob]
    refusal: None


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: str


class ChatChoice(Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName


class ChatCompletion(Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    pdserve: PdserveInfo | None = None


class ChatDelta(Body):
    """What a chunk adds to the message: the role once (first chunk), then text."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName | None


class ChatCompletionChunk(Body):
    """A streamed piece of a chat completion; the last one may carry only `usage`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    pdserve: PdserveInfo | None = None


class ModelCard(Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int = Field(description="the context: prompt plus output tokens")


class ModelList(Body):
    object: Literal["list"]
    data: list[ModelCard]


class Health(Body):
    status: Literal["ok"]


class WorkerList(Body):
    workers: list[dict[str, Any]] = Field(description="registered prefill and decode workers")
