"""Types shared by every pdserve component.

This module imports nothing from the project, so any package may import it without cycles.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


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
        except ValueError:
            names = ", ".join(c.value for c in cls)
            raise InvalidRequestError(
                f"unknown latency class {value!r}; expected one of: {names}",
                code="invalid_latency_class",
                param="latency_class",
            ) from None


_PRIORITY = {LatencyClass.INTERACTIVE: 0, LatencyClass.STANDARD: 1, LatencyClass.BATCH: 2}


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine failed the request


# --------------------------------------------------------------------------- errors


class PdserveError(Exception):
    """Root of every error pdserve raises on purpose. `code` is stable and machine-readable."""

    code: str = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param


class InvalidRequestError(PdserveError):
    """The caller sent something we will never accept (maps to HTTP 400 / INVALID_ARGUMENT)."""

    code = "invalid_request"


class PromptTooLongError(InvalidRequestError):
    code = "context_length_exceeded"


class CapacityError(PdserveError):
    """No worker can take the request now; retrying later may work (HTTP 503 / UNAVAILABLE)."""

    code = "no_capacity"


class RequestAbortedError(PdserveError):
    code = "aborted"


class ModelLoadError(PdserveError):
    code = "model_load_error"


class UnsupportedArchitectureError(ModelLoadError):
    code = "unsupported_architecture"


class KVTransferError(PdserveError):
    code = "kv_transfer_error"


# --------------------------------------------------------------------------- limits

# One set of request limits for every entry point (REST, gRPC, worker APIs), so a request
# one of them accepts is never refused by another, and the published schemas quote them.
MAX_REQUEST_ID_LEN = 256
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16


def check_request_id(request_id: str, *, param: str = "request_id") -> str:
    """Return ``request_id`` if it is 1-MAX_REQUEST_ID_LEN printable ASCII characters
    (what gRPC metadata and log lines can carry verbatim); raise InvalidRequestError."""
    if not (isinstance(request_id, str) and 0 < len(request_id) <= MAX_REQUEST_ID_LEN
            and request_id.isascii() and request_id.isprintable()):
        what = "must not be empty" if request_id == "" else (
            f"must be 1-{MAX_REQUEST_ID_LEN} printable ASCII characters")
        raise InvalidRequestError(f"{param} {what}", code="invalid_request_id", param=param)
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

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, code="invalid_sampling_params", param=param)

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
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    timings_ms: dict[str, float] | None = None
    decode_worker: str | None = None
    prefill_worker: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV block pool: enough to address any block's bytes from outside the engine.

    The pool is ONE contiguous tensor of shape
    ``[num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]`` (block-major),
    so block ``b`` is the byte range ``[b * block_nbytes, (b + 1) * block_nbytes)`` and a run of
    consecutive block ids is one contiguous range.
    """

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    model_id: str  # identity of the weights; KV from another model must never be mixed in

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    @property
    def block_nbytes(self) -> int:
        return (
            self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
            * self.itemsize
        )

    @property
    def pool_nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    def compatible_with(self, other: KVLayout) -> bool:
        """Same per-block layout and model: blocks may be copied between the two pools."""
        return (
            self.num_layers == other.num_layers
            and self.block_size == other.block_size
            and self.num_kv_heads == other.num_kv_heads
            and self.head_dim == other.head_dim
            and self.dtype == other.dtype
            and self.model_id == other.model_id
        )


@dataclass
class StageTimings:
    """Wall-clock stage boundaries of one request (time.monotonic seconds; 0 = not reached)."""

    arrived: float = 0.0
    scheduled: float = 0.0
    prefill_done: float = 0.0
    kv_transferred: float = 0.0
    admitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateRequest:
    """A tokenized request as it travels between gateway, router and workers."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    latency_class: LatencyClass = LatencyClass.STANDARD

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        if len(self.prompt_token_ids) == 0:
            raise InvalidRequestError(
                "prompt must not be empty", code="empty_prompt", param="prompt"
            )
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
