"""Prometheus metrics of a prefill worker, in a registry of its own (no global registry).

KV blocks come from the engine's latest stats at scrape time
(`engine.metrics.EngineStatsCollector`); the queue is read from the worker at scrape time;
compute and transfer durations, bytes and failures are recorded by `PrefillWorker` as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.metrics import EngineStatsCollector
from pdserve.engine.stats import EngineStats

_COMPUTE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0)


class PrefillMetrics:
    """What a PrefillWorker records; `watch` adds the scrape-time gauges of one worker."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_prefill_requests", "Prefill requests by outcome (ok, failed, cancelled, "
            "rejected: refused while draining).", ["outcome"], registry=r)
        self.queue_wait = Histogram(
            "pdserve_prefill_queue_wait_seconds", "Time queued before prefill compute started.",
            ["latency_class"], buckets=_COMPUTE_BUCKETS, registry=r)
        self.compute = Histogram(
            "pdserve_prefill_compute_seconds", "Prefill compute time of one request (KV and "
            "first token).", buckets=_COMPUTE_BUCKETS, registry=r)
        self.computed_tokens = Counter(
            "pdserve_prefill_computed_tokens", "Prompt tokens computed (prefix-cache hits "
            "excluded).", registry=r)
        self.transfer_bytes = Counter(
            "pdserve_prefill_kv_transfer_bytes", "KV bytes written to decode workers.",
            registry=r)
        self.transfer = Histogram(
            "pdserve_prefill_kv_transfer_seconds", "Time successful KV transfers took after the "
            "prompt computed (the parts sent while it computed are not in it).",
            buckets=_TRANSFER_BUCKETS, registry=r)
        self.transfer_failures = Counter(
            "pdserve_prefill_kv_transfer_failures", "Failed KV transfers by error code.",
            ["code"], registry=r)

    def watch(self, worker_id: str, stats: Callable[[], EngineStats],
              queued: Callable[[], Mapping[str, int]], queued_tokens: Callable[[], int],
              running: Callable[[], int]) -> None:
        """Register scrape-time gauges: engine blocks (``stats``), the queue by latency
        class, queued prompt tokens, and prefills holding a slot."""
        self.registry.register(EngineStatsCollector(stats, worker_id, "prefill"))
        self.registry.register(_QueueCollector(worker_id, queued, queued_tokens, running))


class _QueueCollector(Collector):
    def __init__(self, worker_id: str, queued: Callable[[], Mapping[str, int]],
                 queued_tokens: Callable[[], int], running: Callable[[], int]):
        self._worker = worker_id
        self._queued = queued
        self._queued_tokens = queued_tokens
        self._running = running

    def describe(self) -> Iterable[Metric]:
        return self._families(with_values=False)

    def collect(self) -> Iterable[Metric]:
        return self._families(with_values=True)

    def _families(self, *, with_values: bool) -> list[Metric]:
        depth = GaugeMetricFamily("pdserve_prefill_queue_depth",
                                  "Prefill requests waiting for a slot, by latency class.",
                                  labels=["worker", "latency_class"])
        tokens = GaugeMetricFamily("pdserve_prefill_queued_tokens",
                                   "Prompt tokens of the waiting prefill requests.",
                                   labels=["worker"])
        running = GaugeMetricFamily("pdserve_prefill_running_requests",
                                    "Prefill requests holding a slot (computing or "
                                    "transferring).", labels=["worker"])
        if with_values:
            for latency_class, n in sorted(self._queued().items()):
                depth.add_metric([self._worker, latency_class], n)
            tokens.add_metric([self._worker], self._queued_tokens())
            running.add_metric([self._worker], self._running())
        return [depth, tokens, running]
