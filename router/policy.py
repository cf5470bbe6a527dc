"""Routing decisions as pure functions (no I/O), so they are easy to test and to explain."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from pdserve.types import LatencyClass

# Cost placement's first-token targets per latency class (seconds): bench.goodput's SLOs for
# interactive (1 s) and batch (15 s), standard between them.
DEFAULT_TTFT_TARGETS_S: Mapping[LatencyClass, float] = MappingProxyType({
    LatencyClass.INTERACTIVE: 1.0, LatencyClass.STANDARD: 3.0, LatencyClass.BATCH: 15.0})
# Cost placement's price of a second of each class's wait for its first token (and of each
# second past its target), against a second of TPOT or of stall on a running stream. A batch
# prompt's wait is worth a tenth (its target is 15x interactive's): it yields to the
# streams it would stall, so it queues for a prefill worker rather than prefill beside them
# on their decode worker unless that queue is far past its target (router.cost).
DEFAULT_TTFT_WEIGHTS: Mapping[LatencyClass, float] = MappingProxyType({
    LatencyClass.INTERACTIVE: 1.0, LatencyClass.STANDARD: 1.0, LatencyClass.BATCH: 0.1})


class Route(enum.StrEnum):
    LOCAL = "local"
    REMOTE = "remote"
    FALLBACK = "fallback"  # remote was chosen but failed; prefilled locally instead


@dataclass(frozen=True)
class RouterPolicy:
    # Prompts with at least this many uncached tokens are prefilled on the prefill pool.
    remote_min_uncached_tokens: int = 256
    # Skip the pool when its queued prompt tokens exceed this (per latency class; batch
    # requests yield to interactive ones first).
    max_prefill_backlog_tokens: int = 16384
    batch_backlog_fraction: float = 0.5
    # Weight of cache affinity against load when picking a decode worker.
    affinity_weight: float = 2.0
    # Which workers, and local vs remote prefill: "cost" (router.cost: predicted TTFT, decode
    # stall and TPOT from the workers' measured rates; the default since it won or tied
    # everywhere it was measured, docs/BENCHMARKS.md "Router placement") or "threshold" (the
    # rule above, the decode worker by load + cache affinity).
    placement: Literal["threshold", "cost"] = "cost"
    # Cost placement: the first-token time each latency class aims for. A candidate's
    # predicted TTFT past it is priced (router.cost, `late_weight`). Below the admission
    # deadline (router.admission), which is what a request may wait at most before it is
    # refused: a queue that fits a 30 s deadline is not a place to send a standard prompt.
    ttft_targets_s: Mapping[LatencyClass, float] = field(
        default_factory=lambda: DEFAULT_TTFT_TARGETS_S)
    # Cost placement: what a second of each class's TTFT is worth (DEFAULT_TTFT_WEIGHTS).
    ttft_weights: Mapping[LatencyClass, float] = field(
        default_factory=lambda: DEFAULT_TTFT_WEIGHTS)

    def __post_init__(self) -> None:
        # A plain dict (not a read-only proxy): dataclasses.asdict must copy it (the router
        # benchmarks record their policy that way).
        object.__setattr__(self, "ttft_targets_s",
                           {**DEFAULT_TTFT_TARGETS_S, **self.ttft_targets_s})
        object.__setattr__(self, "ttft_weights",
                           {**DEFAULT_TTFT_WEIGHTS, **self.ttft_weights})
        for cls, s in self.ttft_targets_s.items():
            if not (s > 0 and math.isfinite(s)):
                raise ValueError(f"TTFT target of {cls.value} must be > 0, got {s}")
        for cls, w in self.ttft_weights.items():
            if not (w > 0 and math.isfinite(w)):
                raise ValueError(f"TTFT weight of {cls.value} must be > 0, got {w}")

    def ttft_target_s(self, latency_class: LatencyClass, deadline_s: float) -> float:
        """What cost placement holds a request's predicted TTFT to: its class's target,
        never past its admission deadline (`deadline_s`)."""
        return min(self.ttft_targets_s[latency_class], deadline_s)


@dataclass(frozen=True)
class DecodeCandidate:
    worker_id: str
    cached_tokens: int
    running: float
    waiting: float
    free_blocks: float
    total_blocks: float


@dataclass(frozen=True)
class Decision:
    route: Route
    reason: str
    uncached_tokens: int
    predicted_ttft_s: float | None = None  # cost placement's prediction (router.cost)


# A candidate as `best_decode` reads it: (cached_tokens, running, waiting, free_blocks,
# total_blocks). Plain tuples: the router scores every decode worker on every request.
Row = tuple[float, float, float, float, float]


def best_decode(rows: Sequence[Row], prompt_len: int, policy: RouterPolicy,
                tiebreak: int = 0) -> int:
    """Index of the best row: least loaded, with a bonus for holding more of the prompt in
    the prefix cache and a small one for free memory. Equal scores go to the first row from
    position `tiebreak` on (round robin when the caller advances it), so idle workers share
    new prompts instead of the same one taking them all."""
    if not rows:
        raise ValueError("no decode candidates")
    n = len(rows)
    max_load = max(r[1] + r[2] for r in rows) or 1.0
    weight = policy.affinity_weight / max(prompt_len, 1)
    best, best_score = -1, float("-inf")
    for k in range(n):
        i = (tiebreak + k) % n
        cached, running, waiting, free, total = rows[i]
        score = weight * cached - (running + waiting) / max_load + (
            0.5 * free / total if total else 0.0)
        if score > best_score:
            best, best_score = i, score
    return best


def choose_decode(candidates: list[DecodeCandidate], prompt_len: int,
                  policy: RouterPolicy, tiebreak: int = 0) -> DecodeCandidate:
    """`best_decode` over named candidates."""
    rows = [(c.cached_tokens, c.running, c.waiting, c.free_blocks, c.total_blocks)
            for c in candidates]
    return candidates[best_decode(rows, prompt_len, policy, tiebreak)]


def decide_route(prompt_len: int, cached_tokens: int, latency: LatencyClass,
                 prefill_backlog_tokens: float | None, policy: RouterPolicy) -> Decision:
    """`prefill_backlog_tokens` is None when no prefill worker is available."""
    uncached = max(0, prompt_len - cached_tokens)
    if uncached < policy.remote_min_uncached_tokens:
        reason = "cached_prefix" if cached_tokens and prompt_len >= \
            policy.remote_min_uncached_tokens else "short_prompt"
        return Decision(Route.LOCAL, reason, uncached)
    if prefill_backlog_tokens is None:
        return Decision(Route.LOCAL, "no_prefill_worker", uncached)
    limit: float = policy.max_prefill_backlog_tokens
    if latency is LatencyClass.BATCH:
        limit *= policy.batch_backlog_fraction
    if prefill_backlog_tokens > limit:
        return Decision(Route.LOCAL, "prefill_backlog", uncached)
    return Decision(Route.REMOTE, "long_uncached_prompt", uncached)
