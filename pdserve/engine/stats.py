"""The engine's own numbers: a snapshot of one engine (`EngineStats`) and the histogram it
keeps of queue times.

They stay inside the process that runs the engine: its worker turns a snapshot into the load
record it publishes and serves over the Stats RPC (`pdserve.control.load.WorkerLoad`, the one
type of a worker's load outside it), and its /metrics reads them
(`engine.metrics.EngineStatsCollector`). Plain Python, no torch: the engine thread builds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HistogramSnapshot:
    """Cumulative histogram counts: ``counts[i]`` observations were <= ``bounds[i]``; the
    last bound is +inf, so ``counts[-1]`` is the number of observations."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float = 0.0  # the sum of the observations

    @property
    def count(self) -> int:
        return self.counts[-1] if self.counts else 0


class DurationHistogram:
    """A histogram kept by the one thread that observes it; readers get `snapshot()`s.

    Plain Python (no prometheus-client) so the engine thread owns it; a collector turns the
    snapshots into Prometheus histograms.
    """

    def __init__(self, bounds: tuple[float, ...]):
        if list(bounds) != sorted(bounds) or not bounds:
            raise ValueError("histogram bounds must be sorted and non-empty")
        self.bounds = tuple(bounds) if bounds[-1] == math.inf else (*bounds, math.inf)
        self._counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self._total = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self._counts[i] += 1
                break
        self._total += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for n in self._counts:
            running += n
            cumulative.append(running)
        return HistogramSnapshot(self.bounds, tuple(cumulative), self._total)


# Seconds a request waits in the engine's queue before its first step (vLLM's buckets).
QUEUE_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                      50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine, taken on the engine thread (counters are cumulative).

    Prefix-cache queries and hits count prompt tokens, as vLLM does: every admission of a
    prompt queries its tokens, and the leading tokens found in the cache are hits.
    """

    running: int
    waiting: int
    awaiting_kv: int
    held: int
    free_blocks: int
    total_blocks: int
    prefix_cache_hit_rate: float
    steps: int
    preemptions: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Measured by the engine (pdserve.engine.step_rates), for the router's cost model.
    prefill_tokens_per_s: float = 0.0  # 0: no sample yet
    decode_step_s: float = 0.0
    prefill_cpu_share: float = 0.0  # of its CPUs while it prefilled; 0: no sample yet
    threads: int = 0  # torch threads its last step ran on (EngineConfig.adapt_threads)
    waiting_prompt_tokens: int = 0  # prompt tokens admitted and not computed yet
    queue_time: HistogramSnapshot = field(
        default_factory=lambda: DurationHistogram(QUEUE_TIME_BUCKETS).snapshot())

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1."""
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


__all__ = ["QUEUE_TIME_BUCKETS", "DurationHistogram", "EngineStats", "HistogramSnapshot"]
