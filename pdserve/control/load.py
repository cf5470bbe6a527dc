"""The load a worker publishes on every heartbeat: one typed record and its one codec.

Workers write it into their Redis record (`WorkerInfo.load`) as a flat JSON object; the router
reads it back as a `WorkerLoad` to place requests (`router.policy`) and to show every
worker's engine numbers on its /metrics (`engine.metrics.WorkerLoadCollector` reads the
attributes named by the engine table's load keys). A worker's Stats RPC answers with the same
record, fresh from its engine (`pdserve.rpc.convert`: `DecodeStats`, `PrefillStats`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class WorkerLoadError(ValueError):
    """A load record is malformed."""


@dataclass(frozen=True)
class WorkerLoad:
    # Both roles.
    running: float = 0.0  # decode: requests in the batch; prefill: prompts in a pass or sending
    free_blocks: float = 0.0  # KV blocks no request holds
    total_blocks: float = 0.0  # KV blocks in the pool
    # Decode workers.
    waiting: float = 0.0  # queued for a batch slot or a local prefill
    awaiting_kv: float = 0.0  # allocated, KV not landed yet
    streams: float = 0.0  # open Generate/AllocateAndGenerate streams
    # Prefill workers.
    queued: float = 0.0  # prompts waiting for a forward pass
    queued_tokens: float = 0.0  # their tokens: the router's backlog measure
    # The engine's own numbers (engine.metrics load keys); None: not published.
    engine_running: float | None = None
    engine_waiting: float | None = None
    kv_cache_usage: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    preemptions: float | None = None
    used_blocks: float | None = None
    steps: float | None = None
    prefill_tokens_per_s: float | None = None  # measured (0: no sample yet)
    decode_step_s: float | None = None
    # Of its CPUs while it prefilled (CPU over wall seconds per thread; 0: no sample yet).
    prefill_cpu_share: float | None = None
    engine_threads: float | None = None  # torch threads of its last step (--adapt-threads)
    waiting_prompt_tokens: float | None = None
    # Prefill workers: seconds of KV transfer per prompt token (moving average; 0: none yet).
    kv_transfer_s_per_token: float | None = None
    metrics_port: int | None = None  # where the worker serves Prometheus text

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value):
                raise WorkerLoadError(f"load[{f.name!r}] must be a finite number, got {value!r}")

    @property
    def backlog(self) -> float:
        """Decode: requests not yet in the batch (queued, or waiting for their KV)."""
        return self.waiting + self.awaiting_kv

    def to_dict(self) -> dict[str, float]:
        """The JSON object stored in Redis (unpublished numbers left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | WorkerLoad | None) -> WorkerLoad:
        """Keys this build does not know (a newer worker's) are ignored."""
        if data is None:
            return cls()
        if isinstance(data, WorkerLoad):
            return data
        if not isinstance(data, Mapping):
            raise WorkerLoadError(f"load must be a JSON object, got {type(data).__name__}")
        return cls(**{k: data[k] for k in _FIELDS if k in data})


_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerLoad))

__all__ = ["WorkerLoad", "WorkerLoadError"]
