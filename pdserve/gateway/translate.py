"""An OpenAI request -> the pdserve generations that serve it.

A validated body (`gateway.protocol`) becomes ``prompts x best_of`` `GenerateRequest`s with
their `SamplingParams` (the engine checks its own limits there), the tenant's internal ids and
latency class, and the builder its response will be assembled with (`gateway.assemble`).
Tokenizing (and chat templating) runs on a worker thread: a megabyte prompt takes seconds, and
the event loop serves every other request.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Literal, cast

from pdserve.errors import ErrorCode
from pdserve.gateway.assemble import ChatBuilder, CompletionBuilder, ResponseBuilder
from pdserve.gateway.backend import GenerationBackend
from pdserve.gateway.body import validate
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import APIError, bad_request
from pdserve.gateway.protocol import (
    INT64_MAX,
    INT64_MIN,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    OutputFormat,
)
from pdserve.tenants import Tenant
from pdserve.types import (
    MAX_N,
    MAX_REQUEST_ID_LEN,
    GenerateRequest,
    LatencyClass,
    SamplingParams,
    fit_max_tokens,
)

Kind = Literal["completion", "chat"]

LATENCY_CLASS_HEADER = "X-Latency-Class"
MAX_CHOICES = 4 * MAX_N  # generations per request: prompts x best_of
_MESSAGE_KEYS = frozenset({"role", "content", "name"})


@dataclass(frozen=True)
class Prepared:
    """A validated request: ``best_of`` generations per prompt, prompts in order
    (generation ``k`` is sample ``k % best_of`` of prompt ``k // best_of``)."""

    gens: tuple[GenerateRequest, ...]
    builder: ResponseBuilder
    stream: bool
    include_usage: bool
    n: int = 1
    best_of: int = 1
    echo: tuple[str, ...] = ()  # per prompt: text put before each of its choices
    continuous_usage: bool = False
    hide_logprobs: bool = False  # logprobs asked for internally (best_of), not by the client

    @property
    def gen(self) -> GenerateRequest:
        return self.gens[0]

    def index_of(self) -> dict[str, int]:
        return {g.request_id: k for k, g in enumerate(self.gens)}

    def echo_for(self, k: int) -> str:
        return self.echo[k // self.best_of] if self.echo else ""


class Translator:
    """Requests for one backend's model under one gateway config."""

    def __init__(self, backend: GenerationBackend, config: GatewayConfig, model_name: str):
        self.backend = backend
        self.config = config
        self.model_name = model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and \
                model not in self.config.model_aliases:
            shown = model if len(model) <= 100 else model[:100] + "..."
            raise APIError(404, f"the model '{shown}' does not exist; this server serves "
                           f"'{self.model_name}'", code=ErrorCode.MODEL_NOT_FOUND, param="model")

    async def prepare(self, kind: Kind, body: dict[str, Any], request_id: str,
                      header_class: LatencyClass | None, tenant: Tenant) -> Prepared:
        """Validate and tokenize. The generations get the tenant's internal ids (from the
        client's ``request_id``) and at most its latency class."""
        req: CompletionRequest | ChatCompletionRequest
        if kind == "completion":
            req = validate(body, CompletionRequest, UNSUPPORTED_COMPLETION)
        else:
            req = validate(body, ChatCompletionRequest, UNSUPPORTED_CHAT)
        self.check_model(req.model)
        body_class = parse_latency_class(req.latency_class)
        if header_class is not None and body_class is not None and header_class != body_class:
            raise bad_request(f"the {LATENCY_CLASS_HEADER} header ({header_class}) and the "
                              f"latency_class field ({body_class}) disagree",
                              param="latency_class", code=ErrorCode.INVALID_LATENCY_CLASS)
        latency_class = tenant.latency_class(header_class or body_class or LatencyClass.STANDARD)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options")
        logprobs: int | None
        echo = False
        if isinstance(req, CompletionRequest):
            prompt_param = "prompt"
            prompts = await asyncio.to_thread(self._prompts_ids, req.prompt)
            requested = req.max_tokens
            logprobs = req.logprobs
            best_of = req.n if req.best_of is None else req.best_of
            echo = req.echo
            if echo and logprobs is not None:
                raise bad_request("echo with logprobs (prompt logprobs) is not supported",
                                  param="echo", code=ErrorCode.UNSUPPORTED_PARAMETER)
        else:
            prompt_param = "messages"
            ids = await asyncio.to_thread(self.backend.tokenizer.apply_chat_template,
                                          chat_messages(req.messages))
            prompts = [(ids, "")]
            if (req.max_tokens is not None and req.max_completion_tokens is not None
                    and req.max_tokens != req.max_completion_tokens):
                raise bad_request("max_tokens and max_completion_tokens disagree; send one",
                                  param="max_completion_tokens")
            requested = req.max_completion_tokens or req.max_tokens
            if req.top_logprobs is not None and not req.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true",
                                  param="top_logprobs")
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            best_of = req.n
        if best_of < req.n:
            raise bad_request(f"best_of ({best_of}) must be at least n ({req.n})",
                              param="best_of")
        if best_of > req.n and req.stream:
            raise bad_request("best_of > n cannot be streamed", param="best_of")
        if len(prompts) * best_of > MAX_CHOICES:
            raise bad_request(f"at most {MAX_CHOICES} generations per request (prompts x "
                              f"best_of), got {len(prompts) * best_of}", param="prompt")
        hide_logprobs = best_of > req.n and logprobs is None
        common = dict(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None or req.top_k == -1 else req.top_k,
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            ignore_eos=req.ignore_eos,
            logprobs=0 if hide_logprobs else logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=self._logit_bias(req.logit_bias),
            min_p=req.min_p,
            min_tokens=req.min_tokens,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            json_schema=json_schema(req.response_format),
        )
        internal = tenant.request_id(request_id)
        total = len(prompts) * best_of
        gens = []
        for p, (ids, _) in enumerate(prompts):
            max_tokens = fit_max_tokens(len(ids), requested, self.backend.max_model_len,
                                        default=self.config.default_max_tokens,
                                        param=prompt_param)
            for j in range(best_of):
                seed = None if req.seed is None else _wrap_int64(req.seed + j)
                sampling = SamplingParams(max_tokens=max_tokens, seed=seed,
                                          **common)  # type: ignore[arg-type]
                child = internal if total == 1 else \
                    f"{internal[:MAX_REQUEST_ID_LEN - 8]}-{p * best_of + j}"
                gens.append(GenerateRequest(child, tuple(ids), sampling, latency_class))
        builder_cls = CompletionBuilder if kind == "completion" else ChatBuilder
        builder = builder_cls(request_id, self.model_name, int(time.time()),
                              self.backend.tokenizer, logprobs is not None,
                              num_choices=len(prompts) * req.n)
        options = req.stream_options
        return Prepared(tuple(gens), builder, req.stream,
                        include_usage=options is not None and options.include_usage,
                        n=req.n, best_of=best_of,
                        echo=tuple(text for _, text in prompts) if echo else (),
                        continuous_usage=options is not None and options.continuous_usage_stats,
                        hide_logprobs=hide_logprobs)

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        vocab = self.backend.tokenizer.vocab_size
        out = []
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except ValueError as exc:
                raise bad_request(f"logit_bias keys must be token ids, got {key[:32]!r}",
                                  param="logit_bias") from exc
            if not 0 <= token < vocab:
                raise bad_request(f"logit_bias token id {token} is outside the vocabulary "
                                  f"[0, {vocab})", param="logit_bias")
            out.append((token, value))
        return tuple(out)

    def _prompts_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[
            tuple[list[int], str]]:
        """Each prompt's token ids and text (the text only matters for echo)."""
        tok = self.backend.tokenizer
        if isinstance(prompt, str):
            return [(tok.encode(prompt), prompt)]
        # all(isinstance(...)) does not narrow the list's type: cast() says what it checked.
        if prompt and all(isinstance(p, str) for p in prompt):
            return [(tok.encode(p), p) for p in cast(list[str], prompt)]
        if prompt and all(isinstance(p, list) for p in prompt):
            return [self._token_prompt(p) for p in cast(list[list[int]], prompt)]
        return [self._token_prompt(cast(list[int], prompt))]

    def _token_prompt(self, ids: list[int]) -> tuple[list[int], str]:
        vocab = self.backend.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})",
                              param="prompt")
        return [int(t) for t in ids], self.backend.tokenizer.decode(ids)


def parse_latency_class(value: str | None) -> LatencyClass | None:
    return None if value is None or not value.strip() else LatencyClass.parse(value)


def latency_label(body_class: Any) -> str:
    """Metrics label for a request rejected before its latency class was validated."""
    if body_class is None:
        return LatencyClass.STANDARD.value
    try:
        return LatencyClass(str(body_class).strip().lower()).value
    except ValueError:
        return "unknown"


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI message variants -> plain {role, content} strings for the chat template."""
    out = []
    for i, msg in enumerate(messages):
        extra = sorted(set(msg) - _MESSAGE_KEYS)
        if extra:
            raise bad_request(f"messages[{i}].{extra[0]} is not supported by this server",
                              param="messages", code=ErrorCode.UNSUPPORTED_PARAMETER)
        msg = {k: v for k, v in msg.items() if k != "name"}
        if msg.get("role") == "developer":  # OpenAI's newer name for the system role
            msg["role"] = "system"
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad_request(f"messages[{i}].content: only text parts are supported",
                                      param="messages", code=ErrorCode.UNSUPPORTED_PARAMETER)
                texts.append(part["text"])
            msg["content"] = "".join(texts)
        out.append(msg)
    return out


def json_schema(fmt: OutputFormat | None) -> str | None:
    """response_format -> the JSON schema text the engine constrains the output to."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}'
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema",
                          param="response_format")
    return json.dumps(fmt.json_schema.schema_, separators=(",", ":"))


def _wrap_int64(v: int) -> int:
    return (v - INT64_MIN) % (INT64_MAX - INT64_MIN + 1) + INT64_MIN
