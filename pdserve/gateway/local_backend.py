"""The colocated baseline: the gateway's backend is one local AsyncEngine, no router."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator

from prometheus_client import CollectorRegistry

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.metrics import EngineStatsCollector
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.streaming import aclose
from pdserve.types import GenerateRequest, StageTimings, TokenEvent


class EngineBackend:
    """`GenerationBackend` over one AsyncEngine that prefills and decodes every request.

    The caller owns the AsyncEngine's lifecycle (start it before serving, close it after).
    """

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, *,
                 registry: CollectorRegistry | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len: int = engine.max_model_len
        self.metrics_registry = registry if registry is not None else CollectorRegistry()
        self.metrics_registry.register(EngineStatsCollector(lambda: engine.last_stats))

    def ready(self) -> tuple[bool, str]:
        if not self.engine.running:
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
                    timings = StageTimings(
                        first_token_ms=None if first is None else (first - start) * 1e3,
                        total_ms=(now - start) * 1e3)
                    ev = dataclasses.replace(ev, route="local", timings=timings)
                yield ev
        finally:
            await aclose(stream)  # aborts the request in the engine unless it finished
