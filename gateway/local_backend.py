"""The colocated baseline: the gateway's backend is one local AsyncEngine, no router."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.async_engine import AsyncEngine
from engine.llm_engine import EngineStats
from engine.tokenizer import Tokenizer
from engine.types import GenerateRequest, TokenEvent
from gateway.streaming import aclose


class EngineStatsCollector(Collector):
    """Engine gauges read from the latest `EngineStats` at scrape time (no polling task)."""

    def __init__(self, stats: Callable[[], EngineStats], worker: str = "local"):
        self._stats = stats
        self._worker = worker

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._stats())

    def _families(self, s: EngineStats | None) -> list[Metric]:
        families: list[Metric] = []
        for kind, name, doc, value in _ENGINE_METRICS:
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, doc, labels=["worker"])
            if s is not None:
                fam.add_metric([self._worker], value(s))
            families.append(fam)
        return families


_ENGINE_METRICS: tuple[tuple[str, str, str, Callable[[EngineStats], float]], ...] = (
    ("gauge", "pdserve_engine_running_requests", "Requests in the running batch.",
     lambda s: s.running),
    ("gauge", "pdserve_engine_waiting_requests", "Requests waiting to be scheduled.",
     lambda s: s.waiting),
    ("gauge", "pdserve_engine_kv_blocks_free", "Free KV cache blocks.",
     lambda s: s.free_blocks),
    ("gauge", "pdserve_engine_kv_blocks_used", "KV cache blocks in use.",
     lambda s: s.total_blocks - s.free_blocks),
    ("gauge", "pdserve_engine_kv_blocks_total", "KV cache blocks in the pool.",
     lambda s: s.total_blocks),
    ("gauge", "pdserve_engine_prefix_cache_hit_rate",
     "Fraction of prompt tokens served from the prefix cache.",
     lambda s: s.prefix_cache_hit_rate),
    ("counter", "pdserve_engine_steps", "Engine steps run.", lambda s: s.steps),
    ("counter", "pdserve_engine_preemptions", "Sequences preempted.", lambda s: s.preemptions),
)


class EngineBackend:
    """`GenerationBackend` over one AsyncEngine that prefills and decodes every request.

    The caller owns the AsyncEngine's lifecycle (start it before serving, close it after).
    """

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, *,
                 registry: CollectorRegistry | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len: int = engine.engine.max_model_len
        self.metrics_registry = registry if registry is not None else CollectorRegistry()
        self.metrics_registry.register(EngineStatsCollector(lambda: engine.last_stats))

    def ready(self) -> tuple[bool, str]:
        # AsyncEngine has no public "running" flag yet; these two fields are its lifecycle.
        thread = self.engine._thread
        if thread is None or not thread.is_alive() or self.engine._stopping:
            return False, "the engine is not running"
        return True, "ok"

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        start = time.monotonic()
        first: float | None = None
        stream = self.engine.generate(req)
        try:
            async for ev in stream:
                now = time.monotonic()
                if first is None and ev.token_id is not None:
                    first = now
                if ev.finished:
                    timings = {"total_ms": (now - start) * 1e3}
                    if first is not None:
                        timings["first_token_ms"] = (first - start) * 1e3
                    ev = dataclasses.replace(ev, route="local", timings_ms=timings)
                yield ev
        finally:
            await aclose(stream)  # aborts the request in the engine unless it finished
