"""Types shared by every pdserve component: requests, sampling and its limits, token events.

KV geometry is `pdserve.kv_layout`, errors `pdserve.errors`. This module imports nothing
from the project but `pdserve.errors` (which imports nothing from it), so any package may
import it without cycles.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import ErrorCode, InvalidRequestError, PromptTooLongError


class LatencyClass(enum.StrEnum):
    """How urgently a request wants its first token. Lower `priority` is served first."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def priority(self) -> int:
        return _PRIORITY[self]

    @classmethod
    def parse(cls, value: str | None) -> LatencyClass:
        if value is None or value == "":
            return cls.STANDARD
        try:
            return cls(value.strip().lower())
        except ValueError as exc:
            names = ", ".join(c.value for c in cls)
            raise InvalidRequestError(
                f"unknown latency class {value!r}; expected one of: {names}",
                code=ErrorCode.INVALID_LATENCY_CLASS,
                param="latency_class",
            ) from exc


_PRIORITY = {LatencyClass.INTERACTIVE: 0, LatencyClass.STANDARD: 1, LatencyClass.BATCH: 2}


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine failed the request


# --------------------------------------------------------------------------- limits

# One set of request limits for every entry point (REST, gRPC, worker APIs), so a request
# one of them accepts is never refused by another, and the published schemas quote them.
MAX_REQUEST_ID_LEN = 256
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_PENALTY = 2.0  # presence/frequency, as OpenAI
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 1024
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| per token, as OpenAI
MAX_N = 16  # choices per request (n, best_of)
MAX_JSON_SCHEMA_CHARS = 65536


def check_request_id(request_id: str, *, param: str = "request_id") -> str:
    """Return ``request_id`` if it is 1-MAX_REQUEST_ID_LEN printable ASCII characters
    (what gRPC metadata and log lines can carry verbatim); raise InvalidRequestError."""
    if not (isinstance(request_id, str) and 0 < len(request_id) <= MAX_REQUEST_ID_LEN
            and request_id.isascii() and request_id.isprintable()):
        what = "must not be empty" if request_id == "" else (
            f"must be 1-{MAX_REQUEST_ID_LEN} printable ASCII characters")
        raise InvalidRequestError(f"{param} {what}", code=ErrorCode.INVALID_REQUEST_ID, param=param)
    return request_id


def fit_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, *,
                   default: int, param: str = "prompt") -> int:
    """The output budget of a request: ``max_tokens``, or ``default`` clamped to the context
    left after the prompt when None. Raises PromptTooLongError when the prompt plus an explicit
    ``max_tokens`` do not fit in ``max_model_len`` (nor the prompt alone, with one token left)."""
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens", param=param)
    if max_tokens is None:
        return min(default, max_model_len - num_prompt_tokens)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion); reduce the prompt or max_tokens", param=param)
    return max_tokens


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding controls, validated on construction.

    `temperature == 0` means greedy. `top_k == 0` and `top_p == 1` disable those filters.
    `logprobs` is None (off) or the number of top alternatives to return (0 = only the sampled
    token's logprob).

    Penalties follow vLLM (and OpenAI for presence/frequency): `presence_penalty` and
    `frequency_penalty` subtract from the logits of tokens already in the *output*;
    `repetition_penalty` (HF/CTRL style: divide positive logits, multiply negative ones)
    applies to tokens in the prompt or the output. `logit_bias` adds to given token ids before
    everything else. `min_p` drops tokens whose probability is below ``min_p`` times the top
    token's. Until `min_tokens` tokens are out, EOS and `stop_token_ids` cannot be sampled.
    All of them are functions of the token ids alone, so any worker holding the request's
    tokens (e.g. a decode worker after remote prefill) can apply them.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_p: float = 0.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    json_schema: str | None = None  # structured output: the text must match this JSON schema

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, code=ErrorCode.INVALID_SAMPLING_PARAMS, param=param)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad("max_tokens", "max_tokens must be an integer")
        if self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            raise bad("temperature", "temperature must be a finite number")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature",
                      f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise bad("seed", "seed must be an integer")
        if isinstance(self.stop, str) or not isinstance(self.stop, tuple | list):
            raise bad("stop", "stop must be a sequence of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str):
                raise bad("stop", f"stop entries must be strings, got {type(s).__name__}")
            if s == "":
                raise bad("stop", "stop strings must not be empty")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", f"stop token ids must be integers >= 0, got {t!r}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs",
                      f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        self._check_extended(bad)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def _check_extended(self, bad: Any) -> None:
        def number(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise bad(name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                          f"got {v!r}")
        rp = self.repetition_penalty
        if not number(rp) or not 1 / MAX_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", "repetition_penalty must be in "
                      f"[{1 / MAX_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
                      f"got {rp!r}")
        if not number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        mt = self.min_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 0:
            raise bad("min_tokens", f"min_tokens must be an integer >= 0, got {mt!r}")
        if isinstance(self.max_tokens, int) and mt > self.max_tokens:
            raise bad("min_tokens", f"min_tokens ({mt}) must not exceed max_tokens "
                      f"({self.max_tokens})")
        if isinstance(self.logit_bias, dict | str) or not isinstance(self.logit_bias,
                                                                      tuple | list):
            raise bad("logit_bias", "logit_bias must be a sequence of (token id, bias) pairs")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries, "
                      f"got {len(self.logit_bias)}")
        pairs = []
        for pair in self.logit_bias:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise bad("logit_bias", "logit_bias entries must be (token id, bias) pairs")
            t, b = pair
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("logit_bias", f"logit_bias token ids must be integers >= 0, got {t!r}")
            if not number(b) or not -MAX_LOGIT_BIAS_VALUE <= b <= MAX_LOGIT_BIAS_VALUE:
                raise bad("logit_bias", f"logit_bias values must be in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                          f"{MAX_LOGIT_BIAS_VALUE:g}], got {b!r}")
            pairs.append((t, float(b)))
        object.__setattr__(self, "logit_bias", tuple(pairs))
        if self.json_schema is not None and (
                not isinstance(self.json_schema, str) or not self.json_schema
                or len(self.json_schema) > MAX_JSON_SCHEMA_CHARS):
            raise bad("json_schema", "json_schema must be a non-empty string of at most "
                      f"{MAX_JSON_SCHEMA_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One step of a request's output stream.

    `text` is the newly decoded text (may be empty while a multi-byte character is incomplete,
    and holds back text that could still become part of a stop string). The last event of a
    stream has `finish_reason` set; its `token_id` is None when the request ended without a
    new token (abort, error).
    """

    request_id: str
    token_id: int | None
    text: str = ""
    logprob: TokenLogprob | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # Set by the router on the last event: how the prompt was prefilled and where time went.
    route: str | None = None  # "local" | "remote" | "fallback"
    timings: StageTimings | None = None
    decode_worker: str | None = None
    prefill_worker: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class PrefillReport:
    """A finished remote prefill as the prefill worker timed it (ms, its own clock)."""

    worker_id: str
    queued_ms: float  # arrival until its prompt was scheduled
    compute_ms: float  # the forward pass
    transfer_ms: float  # sending the KV (not freeing the blocks afterwards)
    bytes_transferred: int
    num_computed_tokens: int  # prompt tokens run there (the rest hit its own prefix cache)


@dataclass(frozen=True)
class StageTimings:
    """Where one request's time went, in ms (None: stage not reached): the router's stages
    (`router.timings.StageClock`) and the prefill worker's own (`PrefillReport`).

    The fields are those of the `pdserve.v1.StageTimings` message, copied by name
    (`pdserve.rpc.convert`; the proto says what each stage covers and how they add up to
    `first_token_ms`); `kv_bytes` (KV bytes the prefill worker sent) is not a timing and has
    no place there. `to_json()` is the REST API's `timings_ms` object, in field order.
    """

    route_ms: float | None = None
    first_token_ms: float | None = None
    remote_attempt_ms: float | None = None
    decode_allocate_ms: float | None = None
    queued_ms: float | None = None
    prefill_compute_ms: float | None = None
    kv_transfer_ms: float | None = None
    kv_bytes: float | None = None
    handoff_ms: float | None = None
    local_prefill_ms: float | None = None
    total_ms: float | None = None

    def to_json(self) -> dict[str, float]:
        """The stages reached, under the REST API's names (`TIMINGS_JSON_NAMES`)."""
        return {TIMINGS_JSON_NAMES.get(f.name, f.name): value
                for f in dataclasses.fields(self) if (value := getattr(self, f.name)) is not None}


# The two stages the REST API (`X-Pdserve-Timings`, `pdserve.timings_ms`) names differently
# from the proto; every other stage has its field's name there.
TIMINGS_JSON_NAMES: Mapping[str, str] = {"queued_ms": "prefill_queued_ms",
                                         "first_token_ms": "ttft_ms"}


@dataclass(frozen=True)
class GenerateRequest:
    """A tokenized request as it travels between gateway, router and workers."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    latency_class: LatencyClass = LatencyClass.STANDARD
    # Output tokens already generated (and streamed) elsewhere: a request migrated from a
    # decode worker that died resumes after them. The engine treats them as its own output
    # (max_tokens, penalties, seeds by position, stop strings, grammar), so the continuation
    # is what the interrupted stream would have produced.
    resume_output_ids: tuple[int, ...] = ()
    # Where the prompt was read from when it arrived as protobuf: (the tuple above, the
    # repeated field it was read from). A worker's message copies the field, C to C,
    # instead of converting the tuple's Python ints back (`pdserve.rpc.convert.fill_input`),
    # but only while `prompt_token_ids` is that very tuple: a copy of this request with
    # another prompt ignores it. Neither compared nor printed.
    prompt_wire: tuple[tuple[int, ...], Sequence[int]] | None = field(
        default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        if len(self.prompt_token_ids) == 0:
            raise InvalidRequestError(
                "prompt must not be empty", code=ErrorCode.EMPTY_PROMPT, param="prompt"
            )
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "resume_output_ids", tuple(self.resume_output_ids))
        if self.resume_output_ids and len(self.resume_output_ids) >= self.sampling.max_tokens:
            raise InvalidRequestError(
                f"{len(self.resume_output_ids)} resumed output tokens leave none of max_tokens="
                f"{self.sampling.max_tokens} to generate", param="resume_output_ids")

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Everything whose KV a worker computes: the prompt, then any resumed output."""
        if not self.resume_output_ids:
            return self.prompt_token_ids
        return self.prompt_token_ids + self.resume_output_ids
