"""Routing decisions as pure functions (no I/O), so they are easy to test and to explain."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from pdserve.types import LatencyClass


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
    # Local vs remote prefill: "threshold" (the rule above) or "cost" (router.cost: predicted
    # TTFT and decode stall from the workers' measured rates).
    placement: Literal["threshold", "cost"] = "threshold"


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


def choose_decode(candidates: list[DecodeCandidate], prompt_len: int,
                  policy: RouterPolicy) -> DecodeCandidate:
    """Least loaded, with a bonus for holding more of the prompt in the prefix cache."""
    if not candidates:
        raise ValueError("no decode candidates")
    max_load = max(c.running + c.waiting for c in candidates) or 1.0

    def score(c: DecodeCandidate) -> tuple[float, str]:
        load = (c.running + c.waiting) / max_load
        affinity = c.cached_tokens / max(prompt_len, 1)
        memory = c.free_blocks / c.total_blocks if c.total_blocks else 0.0
        return (policy.affinity_weight * affinity - load + 0.5 * memory, c.worker_id)

    return max(candidates, key=score)


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
