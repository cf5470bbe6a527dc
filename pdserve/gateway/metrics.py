"""Request-level Prometheus metrics, registered in the backend's registry.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `pdserve:time_to_first_token_seconds`)
where the meaning is the same; `model_name` is added to every sample when the page is served
(`engine.metrics.labelled_registry`). Latency histograms are observed when a request succeeds,
labelled with the route its last event reports, so TTFT of prefills done remotely and locally
can be told apart. docs/METRICS.md lists every name.
"""

from __future__ import annotations

import time
from typing import Literal

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.types import TokenEvent

log = structlog.get_logger(__name__)

Outcome = Literal["success", "error", "aborted", "rejected"]

# vLLM's buckets, so dashboards built for it read ours the same way.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000, 200000)
_OUTCOME_REASON = {"aborted": "abort", "error": "error"}


class GatewayMetrics:
    """One set per registry: registering twice in the same registry raises ValueError."""

    def __init__(self, registry: CollectorRegistry):
        labels = ["latency_class", "route"]
        r = registry
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds", "Arrival at the gateway to the first token.",
            labels, buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "pdserve:inter_token_latency_seconds", "Time between consecutive output tokens.",
            labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds", "Arrival at the gateway to the last token.",
            labels, buckets=_E2E_BUCKETS, registry=r)
        self.decode_time = Histogram(
            "pdserve:request_decode_time_seconds", "First token to last token of a request.",
            labels, buckets=_E2E_BUCKETS, registry=r)
        self.prompt_len = Histogram(
            "pdserve:request_prompt_tokens", "Prompt length of finished requests, in tokens.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.generation_len = Histogram(
            "pdserve:request_generation_tokens", "Output tokens of finished requests.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.finished = Counter(
            "pdserve:request_success", "Finished requests by finish reason (stop, length; "
            "abort: the client left; error: ended by a failure).", ["finished_reason"],
            registry=r)
        self.prompt_tokens = Counter(
            "pdserve:prompt_tokens", "Prompt tokens of generated requests.", registry=r)
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Output tokens generated.", registry=r)
        self.requests = Counter(
            "pdserve_requests", "Requests by how they ended.", ["outcome", "latency_class"],
            registry=r)
        self.cached_prompt_tokens = Counter(
            "pdserve_cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
            registry=r)
        self.in_flight = Gauge(
            "pdserve_requests_in_flight", "Requests being generated now.", ["latency_class"],
            registry=r)

    def rejected(self, latency_class: str) -> None:
        self.requests.labels("rejected", latency_class).inc()

    def track(self, latency_class: str, arrived: float) -> RequestTracker:
        return RequestTracker(self, latency_class, arrived)


class RequestTracker:
    """Follows one generating request; `finish` records it (metrics and one log line, no
    prompt or output text) exactly once."""

    def __init__(self, metrics: GatewayMetrics, latency_class: str, arrived: float):
        self._m = metrics
        self.latency_class = latency_class
        self.arrived = arrived
        self.token_times: list[float] = []
        self.last: TokenEvent | None = None
        self._done = False
        metrics.in_flight.labels(latency_class).inc()

    def on_event(self, ev: TokenEvent) -> None:
        if ev.token_id is not None:
            self.token_times.append(time.monotonic())
        self.last = ev

    def finish(self, outcome: Outcome) -> None:
        if self._done:
            return
        self._done = True
        m, lc = self._m, self.latency_class
        now = time.monotonic()
        last = self.last
        log.info("request finished", outcome=outcome, latency_class=lc,
                 route=last.route if last else None,
                 prompt_tokens=last.num_prompt_tokens if last else None,
                 cached_tokens=last.num_cached_tokens if last else None,
                 output_tokens=last.num_output_tokens if last else 0,
                 ttft_ms=round((self.token_times[0] - self.arrived) * 1e3, 1)
                 if self.token_times else None,
                 e2e_ms=round((now - self.arrived) * 1e3, 1))
        m.in_flight.labels(lc).dec()
        m.requests.labels(outcome, lc).inc()
        if outcome == "rejected":
            return
        if last is not None:
            m.prompt_tokens.inc(last.num_prompt_tokens)
            m.generation_tokens.inc(last.num_output_tokens)
            m.cached_prompt_tokens.inc(last.num_cached_tokens)
            m.prompt_len.observe(last.num_prompt_tokens)
            m.generation_len.observe(last.num_output_tokens)
            reason = (last.finish_reason.value if outcome == "success" and last.finish_reason
                      else _OUTCOME_REASON.get(outcome))
            if reason is not None:
                m.finished.labels(reason).inc()
        if outcome != "success" or not self.token_times or last is None:
            return
        route = last.route or "unknown"
        first = self.token_times[0]
        m.ttft.labels(lc, route).observe(first - self.arrived)
        itl = m.itl.labels(lc, route)
        for a, b in zip(self.token_times, self.token_times[1:], strict=False):
            itl.observe(b - a)
        m.e2e.labels(lc, route).observe(now - self.arrived)
        m.decode_time.labels(lc, route).observe(self.token_times[-1] - first)
