"""Prometheus metrics of a decode worker, in a registry of its own (no global registry).

Engine queues and KV blocks are read from the engine's latest stats at scrape time
(`engine.metrics.EngineStatsCollector`); request outcomes, remote admissions, KV waits and fenced
transfers are counted by `DecodeWorker` as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.metrics import EngineStatsCollector
from pdserve.engine.stats import EngineStats

_KV_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class DecodeMetrics:
    """What a DecodeWorker records; `watch` adds the scrape-time gauges of one worker."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_decode_requests", "Requests by prefill kind (local, remote) and outcome "
            "(stop, length, abort, error: finish reasons; cancelled: the caller went away; "
            "failed: ended by an exception).", ["kind", "outcome"], registry=r)
        self.refused = Counter(
            "pdserve_decode_requests_refused", "Requests refused at the worker's own limit "
            "(--max-requests): UNAVAILABLE, the router places them elsewhere.", registry=r)
        self.remote_admissions = Counter(
            "pdserve_decode_remote_admissions", "Remotely prefilled requests admitted into "
            "the running batch.", registry=r)
        self.kv_wait = Histogram(
            "pdserve_decode_kv_wait_seconds", "From the remote stream's claim of its "
            "allocation until the request's KV landed (outcome=landed) or the wait ended "
            "otherwise (failed, cancelled).",
            ["outcome"], buckets=_KV_WAIT_BUCKETS, registry=r)
        self.kv_landed_past_lease = Counter(
            "pdserve_decode_kv_landed_past_lease", "Remote prefills whose KV landed after "
            "the first lease on its blocks had run out: kept alive by the renewal each "
            "landed part of it gives (a prefill slower than the router predicted).",
            registry=r)
        self.fenced_transfers = Counter(
            "pdserve_decode_fenced_transfers", "Remote allocations released before admission "
            "(fenced, then freed).", registry=r)
        self.fenced_blocks = Counter(
            "pdserve_decode_fenced_blocks", "KV blocks freed after fencing their transfer.",
            registry=r)
        self.quarantined_blocks = Gauge(
            "pdserve_decode_quarantined_blocks", "KV blocks kept out of use forever because "
            "UCX never confirmed that writes into them ended.", registry=r)

    def watch(self, worker_id: str, stats: Callable[[], EngineStats],
              streams: Callable[[], int], pending: Callable[[], int]) -> None:
        """Register scrape-time gauges: engine queues and blocks (``stats``), open token
        streams and remote allocations still waiting for their KV."""
        self.registry.register(EngineStatsCollector(stats, worker_id, "decode"))
        self.registry.register(_DecodeStateCollector(worker_id, streams, pending))


class _DecodeStateCollector(Collector):
    def __init__(self, worker_id: str, streams: Callable[[], int], pending: Callable[[], int]):
        self._worker = worker_id
        self._gauges: tuple[tuple[str, str, Callable[[], float]], ...] = (
            ("pdserve_decode_active_streams", "Token streams open on this worker.", streams),
            ("pdserve_decode_pending_remote_allocations",
             "Remote allocations not yet admitted.", pending),
        )

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(name, doc, labels=["worker"])
                for name, doc, _ in self._gauges]

    def collect(self) -> Iterable[Metric]:
        for name, doc, value in self._gauges:
            fam = GaugeMetricFamily(name, doc, labels=["worker"])
            fam.add_metric([self._worker], value())
            yield fam
