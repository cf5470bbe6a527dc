"""Workloads: length distributions, named request mixes, and the seeded request list."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from bench.loadgen.errors import ConfigError
from bench.loadgen.prompts import Tokenizer, synthetic_prompt

LATENCY_CLASSES = ("interactive", "standard", "batch")

DistKind = Literal["fixed", "uniform", "normal", "lognormal"]


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution; samples are integers clipped to [low, high].

    fixed: `a`.  uniform: integers in [a, b].  normal: mean `a`, std `b`.
    lognormal: median `a`, sigma `b` (of the underlying normal).
    """

    kind: DistKind
    a: float
    b: float = 0.0
    low: int = 1
    high: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "normal", "lognormal"):
            raise ConfigError(f"unknown length distribution {self.kind!r}")
        if self.a < 1 and self.kind != "normal":
            raise ConfigError(f"{self.kind} length parameter must be >= 1, got {self.a}")
        if self.kind == "uniform" and self.b < self.a:
            raise ConfigError(f"uniform:{self.a:g},{self.b:g} needs a <= b")
        if self.kind in ("normal", "lognormal") and self.b < 0:
            raise ConfigError(f"{self.kind} spread must be >= 0")
        if self.low < 1 or (self.high is not None and self.high < self.low):
            raise ConfigError("length bounds need 1 <= low <= high")

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """`128`, `fixed:128`, `uniform:64,256`, `normal:512,128[,low,high]`,
        `lognormal:512,0.5[,low,high]`."""
        kind, _, params = spec.partition(":")
        if not params:
            kind, params = "fixed", kind
        try:
            values = [float(v) for v in params.split(",")]
        except ValueError:
            raise ConfigError(f"bad length distribution {spec!r}") from None
        arity = {"fixed": (1, 1), "uniform": (2, 2), "normal": (2, 4), "lognormal": (2, 4)}
        if kind not in arity or not arity[kind][0] <= len(values) <= arity[kind][1]:
            raise ConfigError(
                f"bad length distribution {spec!r}; expected e.g. fixed:128, uniform:64,256, "
                "normal:512,128[,low,high], lognormal:512,0.5[,low,high]"
            )
        a, b = values[0], values[1] if len(values) > 1 else 0.0
        low = int(values[2]) if len(values) > 2 else 1
        high = int(values[3]) if len(values) > 3 else None
        return cls(kind, a, b, low, high)  # type: ignore[arg-type]

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self.kind == "fixed":
            values = np.full(size, self.a)
        elif self.kind == "uniform":
            values = rng.integers(int(self.a), int(self.b), size=size, endpoint=True)
        elif self.kind == "normal":
            values = rng.normal(self.a, self.b, size=size)
        else:
            values = rng.lognormal(math.log(self.a), self.b, size=size)
        high = self.high if self.high is not None else np.iinfo(np.int64).max
        return np.clip(np.rint(values), self.low, high).astype(np.int64)


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a mix, drawn with probability proportional to `weight`."""

    name: str
    latency_class: str
    prompt_len: LengthDist
    output_len: LengthDist
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.latency_class not in LATENCY_CLASSES:
            raise ConfigError(
                f"latency class {self.latency_class!r} not in {', '.join(LATENCY_CLASSES)}"
            )
        if not self.weight > 0:
            raise ConfigError("request class weight must be > 0")


@dataclass(frozen=True)
class Workload:
    name: str
    classes: tuple[RequestClass, ...]

    def __post_init__(self) -> None:
        if not self.classes:
            raise ConfigError("a workload needs at least one request class")


_CHAT = RequestClass(
    "chat", "interactive", LengthDist("uniform", 64, 256), LengthDist("uniform", 64, 128)
)
_SUMMARIZE = RequestClass(
    "summarize", "standard", LengthDist("uniform", 1000, 2000), LengthDist("uniform", 24, 40)
)
_LONG_BATCH = RequestClass(
    "long-batch", "batch", LengthDist("uniform", 1000, 2000), LengthDist("uniform", 24, 40)
)

NAMED_WORKLOADS: dict[str, Workload] = {
    # `mixed` scaled to what a small model on a few CPU cores serves at a handful of req/s:
    # short interactive chat plus long batch prompts whose prefill interferes with it.
    "mixed-cpu": Workload(
        "mixed-cpu",
        (
            RequestClass(
                "chat",
                "interactive",
                LengthDist("uniform", 64, 128),
                LengthDist("uniform", 32, 64),
                0.8,
            ),
            RequestClass(
                "long-batch",
                "batch",
                LengthDist("uniform", 1024, 1500),
                LengthDist("uniform", 16, 32),
                0.2,
            ),
        ),
    ),
    # All three latency classes, for overload control (bench/admission.py): short chat,
    # mid-length standard requests and long batch prompts (the latter two prefilled remotely
    # by a 1P1D cluster with the default 256-token remote threshold).
    "mixed3-cpu": Workload(
        "mixed3-cpu",
        (
            RequestClass(
                "chat",
                "interactive",
                LengthDist("uniform", 64, 128),
                LengthDist("uniform", 32, 64),
                0.6,
            ),
            RequestClass(
                "summarize",
                "standard",
                LengthDist("uniform", 384, 640),
                LengthDist("uniform", 24, 48),
                0.25,
            ),
            RequestClass(
                "long-batch",
                "batch",
                LengthDist("uniform", 1024, 1500),
                LengthDist("uniform", 16, 32),
                0.15,
            ),
        ),
    ),
    "chat": Workload("chat", (_CHAT,)),
    "summarize": Workload("summarize", (_SUMMARIZE,)),
    "mixed": Workload(
        "mixed",
        (
            RequestClass("chat", "interactive", _CHAT.prompt_len, _CHAT.output_len, 0.8),
            RequestClass(
                "long-batch", "batch", _LONG_BATCH.prompt_len, _LONG_BATCH.output_len, 0.2
            ),
        ),
    ),
}


def named_workload(name: str) -> Workload:
    try:
        return NAMED_WORKLOADS[name]
    except KeyError:
        raise ConfigError(
            f"unknown workload {name!r}; expected one of: {', '.join(NAMED_WORKLOADS)}"
        ) from None


def custom_workload(
    prompt_len: LengthDist, output_len: LengthDist, latency_class: str = "standard"
) -> Workload:
    return Workload("custom", (RequestClass("custom", latency_class, prompt_len, output_len),))


@dataclass(frozen=True)
class RequestSpec:
    index: int
    class_name: str
    latency_class: str
    prompt: str
    prompt_len: int  # the target; the server's usage count is authoritative when present
    output_len: int  # sent as max_tokens


def build_requests(
    workload: Workload, num_requests: int, seed: int, tokenizer: Tokenizer | None = None
) -> list[RequestSpec]:
    """The same (workload, num_requests, seed) always yields the same requests, whatever the
    rate, so sweeps and system comparisons see identical work."""
    rng = np.random.default_rng([seed, 0])
    weights = np.array([c.weight for c in workload.classes], dtype=float)
    picks = rng.choice(len(workload.classes), size=num_requests, p=weights / weights.sum())
    prompt_lens = np.zeros(num_requests, dtype=np.int64)
    output_lens = np.zeros(num_requests, dtype=np.int64)
    for i, cls in enumerate(workload.classes):
        mask = picks == i
        prompt_lens[mask] = cls.prompt_len.sample(rng, int(mask.sum()))
        output_lens[mask] = cls.output_len.sample(rng, int(mask.sum()))
    specs = []
    for index in range(num_requests):
        cls = workload.classes[picks[index]]
        prompt_rng = np.random.default_rng([seed, 1, index])
        prompt = synthetic_prompt(int(prompt_lens[index]), prompt_rng, tokenizer)
        specs.append(
            RequestSpec(
                index=index,
                class_name=cls.name,
                latency_class=cls.latency_class,
                prompt=prompt,
                prompt_len=int(prompt_lens[index]),
                output_len=int(output_lens[index]),
            )
        )
    return specs
