"""Settings every worker process has, whatever its role."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from pdserve.engine.config import EngineConfig

if TYPE_CHECKING:
    from pdserve.rpc.auth import ClusterSecret
    from pdserve.rpc.tls import TLSConfig


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    redis_url: str
    model: str | None = None
    served_model_name: str | None = None  # metric label; None: the model directory's name
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""  # how other processes reach us; "": `host`
    metrics_port: int = 0  # Prometheus text on http://host:metrics_port; 0: any, -1: off
    namespace: str = "default"
    lease_ttl_s: float = 3.0
    heartbeat_s: float = 1.0
    drain_timeout_s: float = 60.0
    # Requests the worker holds at most (queued, running, awaiting KV); more are refused with
    # UNAVAILABLE so the router goes elsewhere: a worker's memory stays bounded.
    max_requests: int = 256
    # Authenticates gRPC callers and KV writes (pdserve.rpc.auth); None: open, with a warning.
    cluster_secret: ClusterSecret | None = None
    # TLS on the gRPC and metrics listeners, a client certificate from its CA required
    # (pdserve.rpc.tls); None: plaintext.
    tls: TLSConfig | None = None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """The gRPC port's credentials: mTLS with `tls`, else None (plaintext)."""
        return None if self.tls is None else self.tls.server_credentials("require")

    def model_name(self, model_dir_name: str) -> str:
        return self.served_model_name or model_dir_name
