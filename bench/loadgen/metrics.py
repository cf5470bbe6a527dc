"""Per-request results and the pure functions that turn them into reported numbers.

Times on `RequestResult` are seconds; everything reported (`Percentiles`) is milliseconds,
the unit SLOs are written in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from bench.loadgen.config import SLO


@dataclass(frozen=True)
class RequestResult:
    index: int
    latency_class: str
    prompt_tokens: int  # usage.prompt_tokens, else the synthetic target
    max_tokens: int
    output_tokens: int  # usage.completion_tokens, else the number of content chunks
    start_s: float  # since the run started
    ttft_s: float | None
    e2e_s: float | None
    itl_s: tuple[float, ...] = ()
    status: int | None = None
    error: str | None = None  # None means success
    # What a pdserve server reported when asked (X-Pdserve-Timings: 1): where the prompt was
    # prefilled ("local", "remote", "fallback") and its stage timings in ms.
    route: str | None = None
    server_timings_ms: Mapping[str, float] | None = None
    # The Retry-After header of a refusal (429/503), in seconds, when the server sent one.
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None when there is no second token."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def token_times(r: RequestResult) -> list[float]:
    """When each content chunk of a successful request arrived, seconds since the run
    started: the first at start + TTFT, then one per inter-token latency."""
    if not r.ok or r.ttft_s is None:
        return []
    times = [r.start_s + r.ttft_s]
    for gap in r.itl_s:
        times.append(times[-1] + gap)
    return times


def steady_output_throughput(results: Sequence[RequestResult],
                             concurrency: int) -> float | None:
    """Output tokens/s of a closed loop while it was full: from the moment the first
    ``concurrency`` requests to start had all finished (each replaced at once, so every slot
    has been refilled at least once) to the start of the last request (after which the loop
    drains). The whole run's rate also counts the first wave's prefill with nothing decoding
    and the last wave's tail, which weigh more the fewer waves a run has. A request's tokens
    are spread over its chunks (a chunk may carry several). None when a request failed, a
    request lacks its timings, or the window is empty (fewer than about two waves)."""
    if (not results or concurrency < 1 or any(not r.ok for r in results)
            or any(r.ttft_s is None or r.e2e_s is None for r in results)):
        return None
    by_start = sorted(results, key=lambda r: r.start_s)
    begin = max(r.start_s + (r.e2e_s or 0.0) for r in by_start[:concurrency])
    end = by_start[-1].start_s
    if end <= begin:
        return None
    tokens = 0.0
    for r in results:
        times = token_times(r)
        inside = sum(1 for t in times if begin <= t <= end)
        tokens += r.output_tokens * inside / len(times) if times else 0.0
    return tokens / (end - begin)


def meets_ttft(r: RequestResult, slo: SLO) -> bool:
    ttft_ms, _ = slo.limits(r.latency_class)
    return r.ok and r.ttft_s is not None and r.ttft_s * 1000.0 <= ttft_ms


def meets_tpot(r: RequestResult, slo: SLO) -> bool:
    _, tpot_ms = slo.limits(r.latency_class)
    tpot = r.tpot_s  # a one-token answer has no TPOT and cannot miss it
    return r.ok and (tpot is None or tpot * 1000.0 <= tpot_ms)


def meets_slo(r: RequestResult, slo: SLO) -> bool:
    return meets_ttft(r, slo) and meets_tpot(r, slo)


@dataclass(frozen=True)
class Percentiles:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> Percentiles | None:
        if not values_ms:
            return None
        arr = np.asarray(values_ms, dtype=float)
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return cls(
            len(arr), float(arr.mean()), float(p50), float(p90), float(p99), float(arr.max())
        )


@dataclass(frozen=True)
class Attainment:
    """Fractions of *all* requests (failures count as misses) meeting each SLO."""

    both: float
    ttft_only: float
    tpot_only: float


@dataclass(frozen=True)
class GroupSummary:
    num_requests: int
    num_ok: int
    num_errors: int
    ttft_ms: Percentiles | None
    tpot_ms: Percentiles | None
    itl_ms: Percentiles | None
    e2e_ms: Percentiles | None
    attainment: Attainment


@dataclass(frozen=True)
class RunSummary:
    duration_s: float
    num_sent: int
    num_unsent: int  # not sent because max_duration_s ran out first
    request_throughput: float  # successful requests / s
    output_token_throughput: float  # tokens of successful requests / s
    input_token_throughput: float
    overall: GroupSummary
    by_class: dict[str, GroupSummary]
    errors: dict[str, int]  # error message (truncated) -> count


def summarize_group(results: Sequence[RequestResult], slo: SLO) -> GroupSummary:
    ok = [r for r in results if r.ok]
    n = len(results)

    def frac(pred: list[bool]) -> float:
        return sum(pred) / n if n else 0.0

    return GroupSummary(
        num_requests=n,
        num_ok=len(ok),
        num_errors=n - len(ok),
        ttft_ms=Percentiles.of([r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None]),
        tpot_ms=Percentiles.of([t * 1000.0 for r in ok if (t := r.tpot_s) is not None]),
        itl_ms=Percentiles.of([x * 1000.0 for r in ok for x in r.itl_s]),
        e2e_ms=Percentiles.of([r.e2e_s * 1000.0 for r in ok if r.e2e_s is not None]),
        attainment=Attainment(
            both=frac([meets_slo(r, slo) for r in results]),
            ttft_only=frac([meets_ttft(r, slo) for r in results]),
            tpot_only=frac([meets_tpot(r, slo) for r in results]),
        ),
    )


def summarize(
    results: Sequence[RequestResult], slo: SLO, duration_s: float, num_unsent: int = 0
) -> RunSummary:
    ok = [r for r in results if r.ok]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    classes = sorted({r.latency_class for r in results})
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            key = r.error[:120]
            errors[key] = errors.get(key, 0) + 1
    return RunSummary(
        duration_s=duration_s,
        num_sent=len(results),
        num_unsent=num_unsent,
        request_throughput=len(ok) * per_s,
        output_token_throughput=sum(r.output_tokens for r in ok) * per_s,
        input_token_throughput=sum(r.prompt_tokens for r in ok) * per_s,
        overall=summarize_group(results, slo),
        by_class={
            c: summarize_group([r for r in results if r.latency_class == c], slo) for c in classes
        },
        errors=errors,
    )


@dataclass(frozen=True)
class Goodput:
    """`rate`: the highest swept rate whose attainment >= target (None if none passed).
    `interpolated`: where attainment crosses the target, linearly between that rate and the
    next (failing) one; equals `rate` when no swept rate above it failed (`bounded` False,
    meaning the real goodput may be higher)."""

    target: float
    rate: float | None
    interpolated: float | None
    bounded: bool


def goodput(points: Sequence[tuple[float, float]], target: float = 0.9) -> Goodput:
    """`points` are (request rate, SLO attainment) pairs from a sweep, in any order."""
    ordered = sorted(points)
    passing = [i for i, (_, att) in enumerate(ordered) if att >= target]
    if not passing:
        return Goodput(target, None, None, bounded=True)
    i = passing[-1]
    rate, att = ordered[i]
    if i + 1 == len(ordered):
        return Goodput(target, rate, rate, bounded=False)
    next_rate, next_att = ordered[i + 1]
    # att >= target > next_att, so the denominator is positive.
    interpolated = rate + (att - target) / (att - next_att) * (next_rate - rate)
    return Goodput(target, rate, interpolated, bounded=True)
