"""The router's own Prometheus metrics (its workers' engine numbers come from their load
records, `pdserve.engine.metrics.WorkerLoadCollector`)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# 0.1 ms steps to 3 ms (the targets are 0.5 ms p50 and 2 ms p99), then coarser.
OVERHEAD_BUCKETS = (*(round(i * 1e-4, 4) for i in range(1, 31)), 0.004, 0.005,
                    0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
# Observed / predicted first-token time: 1 is a prediction that held.
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.decisions = Counter("pdserve_router_decisions_total",
                                 "Routing decisions by route and reason", ["route", "reason"],
                                 registry=registry)
        # Its children by (route, reason), kept: `labels()` takes a lock and checks its
        # arguments on every call, on every request's first step.
        self._decided: dict[tuple[str, str], Counter] = {}
        self.placement_cpu = Counter(
            "pdserve_router_placement_cpu_seconds",
            "CPU time of the router's thread spent placing requests (prefix walk, scoring, "
            "in-flight ledger); over pdserve_router_decisions_total: the CPU of one decision",
            registry=registry)
        self.fallbacks = Counter("pdserve_router_fallbacks_total",
                                 "Remote prefills that failed and were redone locally",
                                 ["cause"], registry=registry)
        self.retries = Counter("pdserve_router_decode_retries_total",
                               "Requests moved to another decode worker before any token",
                               registry=registry)
        self.migrations = Counter("pdserve_router_migrations_total",
                                  "Streams moved to another decode worker after their first "
                                  "token (its worker died, hung or left), by error code",
                                  ["cause"], registry=registry)
        self.workers_lost = Counter("pdserve_router_workers_lost_total",
                                    "Workers whose lease lapsed and that did not answer a probe",
                                    ["role"], registry=registry)
        self.overhead = Histogram(
            "pdserve_router_overhead_seconds",
            "The router's own time on a gRPC request's way to its first token (locally "
            "prefilled, placed once): part=in from the call's arrival to its request on its "
            "way to the decode worker, part=out from the worker's first reply read to the "
            "client's first response handed to grpc, part=total both "
            "(router.timings.OwnTime)",
            ["part"], buckets=OVERHEAD_BUCKETS, registry=registry)
        self.overhead_parts = tuple(self.overhead.labels(p) for p in ("in", "out", "total"))
        self.ttft_ratio = Histogram(
            "pdserve_router_ttft_prediction_ratio",
            "A request's first token after its placement, over what cost placement predicted "
            "for it (corrections included; first placement only, by the route it took)",
            ["route"], buckets=RATIO_BUCKETS, registry=registry)
        self.ttft_ratios = {r: self.ttft_ratio.labels(r) for r in ("local", "remote")}
        self.remote_overhead = Gauge(
            "pdserve_router_remote_overhead_correction_seconds",
            "What cost placement adds to its fixed cost of a remote prefill: the median miss "
            "of the allocation + hand-off measured on recent remote requests "
            "(router.calibration)", registry=registry)
        self.rejections = Counter("pdserve_router_rejections_total",
                                  "Requests refused by admission control (HTTP 429, gRPC "
                                  "RESOURCE_EXHAUSTED)", ["latency_class", "reason"],
                                  registry=registry)

    def decided(self, route: str, reason: str) -> None:
        """Count a routing decision (`decisions`)."""
        child = self._decided.get((route, reason))
        if child is None:
            child = self._decided[route, reason] = self.decisions.labels(route, reason)
        child.inc()

    def gauges(self, *, in_flight: Callable[[], float], predicted_wait_s: Callable[[], float],
               directory_staleness_s: Callable[[], float],
               peer_routers: Callable[[], float]) -> None:
        Gauge("pdserve_router_in_flight", "Requests admitted and not finished",
              registry=self.registry).set_function(in_flight)
        Gauge("pdserve_router_predicted_wait_seconds",
              "Predicted wait for a first token of a request admitted now",
              registry=self.registry).set_function(predicted_wait_s)
        Gauge("pdserve_router_directory_staleness_seconds",
              "Seconds since the worker directory last read Redis (grows while Redis is "
              "unreachable; routing stops past the directory's max_staleness_s)",
              registry=self.registry).set_function(directory_staleness_s)
        Gauge("pdserve_router_peer_routers",
              "Other routers on this Redis whose in-flight counts placement takes in "
              "(router replicas)", registry=self.registry).set_function(peer_routers)
