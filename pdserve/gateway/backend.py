"""What the gateway needs from whatever generates tokens.

The central router implements this in-process, so the gateway adds no network hop on the
token path; `gateway.local_backend.EngineBackend` implements it on one local AsyncEngine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry

from pdserve.engine.tokenizer import Tokenizer
from pdserve.types import GenerateRequest, TokenEvent


@runtime_checkable
class GenerationBackend(Protocol):
    """Contract between the REST gateway and the serving system behind it.

    - `generate(req)` returns an async generator of TokenEvents ending with one whose
      `finish_reason` is set; that last event carries `route` ("local" | "remote" |
      "fallback") and, where known, `timings`. It may raise a `PdserveError` (e.g.
      `CapacityError`, `PromptTooLongError`) before its first event or between events; an engine
      failure may instead end the stream with `finish_reason=ERROR` and `error` set.
    - Closing the generator (`aclose()`) or cancelling the task awaiting it cancels the request
      everywhere (workers abort it and free its KV blocks). It must be an async generator, or
      anything else with `aclose()`. The gateway cancels with plain asyncio (one
      CancelledError, no anyio cancel scope), so the generator's cleanup may await (e.g. an
      abort RPC); it should still bound those waits.
    - `ready()` is (False, reason) while no decode worker can take requests.
    - `metrics_registry` holds the backend's own metrics; the gateway registers its metrics in
      the same registry so one /metrics page shows both.
    """

    @property
    def model_name(self) -> str: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def metrics_registry(self) -> CollectorRegistry: ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]: ...

    def ready(self) -> tuple[bool, str]: ...


@runtime_checkable
class ListsWorkers(Protocol):
    """Optional: a backend with a worker directory (the router). Enables
    ``GET /v1/pdserve/workers``; items are dataclasses (e.g. control.workers.WorkerInfo)."""

    def workers(self, role: str) -> Sequence[Any]: ...
