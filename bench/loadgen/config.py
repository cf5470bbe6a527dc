"""Run configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import httpx

from bench.loadgen.errors import ConfigError, NonLocalTargetError
from bench.loadgen.workload import Workload, named_workload

ApiKind = Literal["completions", "chat"]

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})

API_PATHS: Mapping[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def check_local_url(url: str) -> str:
    """Return `url` without a trailing slash, or raise NonLocalTargetError.

    Only loopback targets are allowed so that a typo can never turn the tool into a load test
    of somebody else's server.
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ConfigError(f"invalid target URL {url!r}: {exc}") from exc
    if parsed.scheme not in ("http", "https"):
        raise ConfigError(f"target URL {url!r} must start with http:// or https://")
    host = parsed.host.lower()
    if host not in LOCAL_HOSTS:
        allowed = ", ".join(sorted(LOCAL_HOSTS))
        raise NonLocalTargetError(
            f"refusing to send load to {host!r}: only local targets ({allowed}) are allowed"
        )
    return url.rstrip("/")


@dataclass(frozen=True)
class SLO:
    """A request meets the SLO when TTFT <= ttft_ms and TPOT <= tpot_ms and it did not fail.

    `target` is the fraction of requests that must meet it for a rate to count as "good".
    `per_class` overrides both limits for a latency class, as (class, ttft_ms, tpot_ms), e.g.
    a looser TTFT for long batch prompts whose prefill alone exceeds the interactive limit.
    """

    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0
    target: float = 0.9
    per_class: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_class", tuple(tuple(c) for c in self.per_class))
        limits = [(self.ttft_ms, self.tpot_ms), *((t, p) for _, t, p in self.per_class)]
        if not all(ttft > 0 and tpot > 0 for ttft, tpot in limits):
            raise ConfigError("SLO latencies must be positive")
        if not 0.0 < self.target <= 1.0:
            raise ConfigError(f"SLO target must be in (0, 1], got {self.target}")
        names = [name for name, _, _ in self.per_class]
        if len(set(names)) != len(names):
            raise ConfigError(f"per-class SLOs name a class twice: {names}")

    def limits(self, latency_class: str) -> tuple[float, float]:
        """(ttft_ms, tpot_ms) that apply to a request of `latency_class`."""
        for name, ttft_ms, tpot_ms in self.per_class:
            if name == latency_class:
                return ttft_ms, tpot_ms
        return self.ttft_ms, self.tpot_ms

    def describe(self) -> str:
        text = f"TTFT <= {self.ttft_ms:g} ms, TPOT <= {self.tpot_ms:g} ms"
        for name, ttft_ms, tpot_ms in self.per_class:
            text += f"; {name}: TTFT <= {ttft_ms:g} ms, TPOT <= {tpot_ms:g} ms"
        return text


@dataclass(frozen=True)
class RunConfig:
    """One bounded run against one endpoint.

    Open loop (default): requests arrive at `rate` req/s (inf = all at once) with gamma
    inter-arrivals of shape `burstiness` (1.0 = Poisson), optionally capped at
    `max_concurrency` in flight. Closed loop: set `concurrency`; that many workers each send
    the next request as soon as their previous one ends, or, when it was refused with a
    Retry-After (a server shedding load), once that wait is over (at most
    `max_retry_after_s`; 0: never wait), as the `openai` client does. Either way the run
    stops after `num_requests` or `max_duration_s`, whichever comes first; requests still in
    flight at the deadline are cancelled and count as errors.
    """

    url: str
    api: ApiKind = "completions"
    model: str | None = None  # None: ask GET /v1/models
    workload: Workload = field(default_factory=lambda: named_workload("chat"))
    num_requests: int = 100
    max_duration_s: float = 600.0
    rate: float = math.inf
    burstiness: float = 1.0
    concurrency: int | None = None
    max_concurrency: int | None = None
    max_retry_after_s: float = 30.0
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    ignore_eos: bool = False
    temperature: float | None = 0.0
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    warmup_requests: int = 0
    tokenizer_path: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", check_local_url(self.url))
        if self.api not in API_PATHS:
            raise ConfigError(f"api must be one of {sorted(API_PATHS)}, got {self.api!r}")
        if self.num_requests < 1:
            raise ConfigError("num_requests must be >= 1")
        if not self.max_duration_s > 0:
            raise ConfigError("max_duration_s must be > 0")
        if not self.rate > 0:
            raise ConfigError(f"rate must be > 0 (inf = all at once), got {self.rate}")
        if not self.burstiness > 0:
            raise ConfigError(f"burstiness must be > 0, got {self.burstiness}")
        for name in ("concurrency", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1")
        if not self.max_retry_after_s >= 0:
            raise ConfigError("max_retry_after_s must be >= 0")
        if self.warmup_requests < 0:
            raise ConfigError("warmup_requests must be >= 0")
        if not (self.request_timeout_s > 0 and self.connect_timeout_s > 0):
            raise ConfigError("timeouts must be positive")

    @property
    def endpoint(self) -> str:
        return self.url + API_PATHS[self.api]

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None

    def with_rate(self, rate: float) -> RunConfig:
        return replace(self, rate=rate)
