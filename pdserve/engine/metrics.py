"""Engine metrics for Prometheus: one table of engine gauges and counters, read two ways.

- `EngineStatsCollector` reads an engine's latest `EngineStats` at scrape time (a worker's
  own metrics port, or the colocated gateway); no polling task.
- `WorkerLoadCollector` reads the same numbers from the load records workers publish in the
  control plane (`engine_load` writes them), so a router shows every worker's engine on its
  own /metrics, labelled by worker, without a scrape of the workers.

Names follow vLLM's (`vllm:num_requests_running` -> `pdserve:num_requests_running`) where
the meaning is the same; `model_name` is added to every sample at exposition by
`labelled_registry` (prometheus-client has no constant labels). docs/METRICS.md lists them all.
Torch-free: the router imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pdserve.aio import TimeSlice
from pdserve.engine.stats import EngineStats

MODEL_LABEL = "model_name"


@dataclass(frozen=True)
class EngineMetric:
    """One engine number: its Prometheus name and type, how to read it from `EngineStats`,
    and its key in a worker's load record."""

    name: str
    kind: Literal["gauge", "counter"]
    doc: str
    read: Callable[[EngineStats], float]
    load_key: str


ENGINE_METRICS: tuple[EngineMetric, ...] = (
    EngineMetric("pdserve:num_requests_running", "gauge",
                 "Requests in the engine's running batch (prefilling or decoding).",
                 lambda s: s.running, "engine_running"),
    EngineMetric("pdserve:num_requests_waiting", "gauge",
                 "Requests queued in the engine, waiting to be scheduled.",
                 lambda s: s.waiting, "engine_waiting"),
    EngineMetric("pdserve:kv_cache_usage_perc", "gauge",
                 "Fraction of KV-cache blocks in use (1 = full).",
                 lambda s: s.kv_cache_usage, "kv_cache_usage"),
    EngineMetric("pdserve:prefix_cache_queries", "counter",
                 "Prompt tokens looked up in the prefix cache.",
                 lambda s: s.prefix_cache_queries, "prefix_cache_queries"),
    EngineMetric("pdserve:prefix_cache_hits", "counter",
                 "Prompt tokens found in the prefix cache.",
                 lambda s: s.prefix_cache_hits, "prefix_cache_hits"),
    EngineMetric("pdserve:num_preemptions", "counter",
                 "Sequences preempted (blocks freed, recomputed later).",
                 lambda s: s.preemptions, "preemptions"),
    EngineMetric("pdserve_engine_awaiting_kv_requests", "gauge",
                 "Requests whose blocks are allocated and whose KV is still being written.",
                 lambda s: s.awaiting_kv, "awaiting_kv"),
    EngineMetric("pdserve_engine_kv_blocks_free", "gauge", "Free KV-cache blocks.",
                 lambda s: s.free_blocks, "free_blocks"),
    EngineMetric("pdserve_engine_kv_blocks_used", "gauge", "KV-cache blocks in use.",
                 lambda s: s.total_blocks - s.free_blocks, "used_blocks"),
    EngineMetric("pdserve_engine_kv_blocks_total", "gauge", "KV-cache blocks in the pool.",
                 lambda s: s.total_blocks, "total_blocks"),
    EngineMetric("pdserve_engine_steps", "counter", "Engine steps run.",
                 lambda s: s.steps, "steps"),
    # Measured step costs (pdserve.engine.step_rates): the router's cost model reads them
    # from the load record.
    EngineMetric("pdserve_engine_prefill_tokens_per_second", "gauge",
                 "Prompt tokens per second in steps that prefilled (moving average; 0: none "
                 "yet).", lambda s: s.prefill_tokens_per_s, "prefill_tokens_per_s"),
    EngineMetric("pdserve_engine_decode_step_seconds", "gauge",
                 "Seconds of a step that prefilled nothing (moving average; 0: none yet).",
                 lambda s: s.decode_step_s, "decode_step_s"),
    EngineMetric("pdserve_engine_prefill_cpu_share", "gauge",
                 "Share of its CPUs the engine had in steps that prefilled: CPU seconds over "
                 "wall seconds per thread (moving average; 0: none yet).",
                 lambda s: s.prefill_cpu_share, "prefill_cpu_share"),
    EngineMetric("pdserve_engine_threads", "gauge",
                 "Torch threads the engine's last step ran on (fewer than configured where "
                 "other processes took its CPUs and it adapts: --adapt-threads).",
                 lambda s: s.threads, "engine_threads"),
    EngineMetric("pdserve_engine_waiting_prompt_tokens", "gauge",
                 "Prompt tokens admitted and not computed yet.",
                 lambda s: s.waiting_prompt_tokens, "waiting_prompt_tokens"),
)

QUEUE_TIME = "pdserve:request_queue_time_seconds"
_LABELS = ["worker", "role"]  # model_name is added at exposition
_QUEUE_TIME_DOC = "Time a request waited in the engine's queue before its first step."


def engine_load(stats: EngineStats) -> dict[str, float]:
    """The engine's numbers as a worker publishes them in its load record."""
    return {m.load_key: float(m.read(stats)) for m in ENGINE_METRICS}


def _family(m: EngineMetric, labels: list[str]) -> GaugeMetricFamily | CounterMetricFamily:
    if m.kind == "gauge":
        return GaugeMetricFamily(m.name, m.doc, labels=labels)
    return CounterMetricFamily(m.name, m.doc, labels=labels)


class EngineStatsCollector(Collector):
    """The engine table and the queue-time histogram of one engine, read at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], worker: str = "local",
                 role: str = "colocated"):
        self._stats = stats
        self._labels = [worker, role]

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._stats())

    def _families(self, s: EngineStats | None) -> list[Metric]:
        families: list[Metric] = []
        for m in ENGINE_METRICS:
            fam = _family(m, _LABELS)
            if s is not None:
                fam.add_metric(self._labels, m.read(s))
            families.append(fam)
        queue = HistogramMetricFamily(QUEUE_TIME, _QUEUE_TIME_DOC, labels=_LABELS)
        if s is not None:
            h = s.queue_time
            buckets = [(_le(b), float(n)) for b, n in zip(h.bounds, h.counts, strict=True)]
            queue.add_metric(self._labels, buckets, h.total)
        families.append(queue)
        return families


class WorkerLoadCollector(Collector):
    """The engine table for every worker a router knows, from their published load records.

    ``workers`` returns (worker id, role, load) triples; a load is a mapping or an object
    with the load keys as attributes. Numbers a worker does not publish are left out.
    """

    def __init__(self, workers: Callable[[], Iterable[tuple[str, str, Any]]]):
        self._workers = workers

    def describe(self) -> Iterable[Metric]:
        return [_family(m, _LABELS) for m in ENGINE_METRICS]

    def collect(self) -> Iterable[Metric]:
        workers = sorted(self._workers(), key=lambda w: w[0])
        for m in ENGINE_METRICS:
            fam = _family(m, _LABELS)
            for worker_id, role, load in workers:
                value = _load_value(load, m.load_key)
                if value is not None:
                    fam.add_metric([worker_id, role], value)
            yield fam


def _load_value(load: Any, key: str) -> float | None:
    value = load.get(key) if isinstance(load, Mapping) else getattr(load, key, None)
    return None if value is None else float(value)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class _ConstLabels(Collector):
    def __init__(self, inner: CollectorRegistry, labels: Mapping[str, str]):
        self._inner = inner
        self._labels = dict(labels)

    def collect(self) -> Iterable[Metric]:
        for fam in self._inner.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [s._replace(labels={**self._labels, **s.labels})
                           for s in fam.samples]
            yield out


class _Family(Collector):
    def __init__(self, family: Metric):
        self._family = family

    def collect(self) -> Iterable[Metric]:
        return (self._family,)


async def exposition(registry: Collector, budget_s: float = 0.0002) -> bytes:
    """`generate_latest(registry)`, byte for byte, rendered in event-loop steps of about
    `budget_s` (`TimeSlice`; a family is never split): a router's page holds every worker's
    gauges, and rendered in one step it held the loop (and every request on it) for 7-13 ms
    at 64 workers; four families a step still held it 4.5 ms p50, 26 ms at most, at 256."""
    parts = []
    pass_ = TimeSlice(budget_s)
    for family in registry.collect():
        parts.append(generate_latest(_Family(family)))
        await pass_.step()
    return b"".join(parts)


def labelled_registry(inner: CollectorRegistry, **labels: str) -> CollectorRegistry:
    """A registry exposing every metric of ``inner`` with ``labels`` added to each sample
    that lacks them (Prometheus' constant labels), e.g. ``model_name=...``. Metrics
    registered in ``inner`` later show up too."""
    exposed = CollectorRegistry(auto_describe=False)
    exposed.register(_ConstLabels(inner, labels))
    return exposed


__all__ = ["ENGINE_METRICS", "MODEL_LABEL", "QUEUE_TIME", "EngineStatsCollector",
           "WorkerLoadCollector", "engine_load", "exposition", "labelled_registry"]
