"""Settings every worker process has, whatever its role."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    redis_url: str
    model: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""  # how other processes reach us; "": `host`
    metrics_port: int = 0  # Prometheus text on http://host:metrics_port; 0: any, -1: off
    namespace: str = "default"
    lease_ttl_s: float = 3.0
    heartbeat_s: float = 1.0
    drain_timeout_s: float = 60.0
