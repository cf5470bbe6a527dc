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
    # Bounds on the gRPC server, whoever calls (docs/RELIABILITY.md, Security). The largest
    # request message; None: `default_max_message_bytes` of the model's context length.
    max_message_bytes: int | None = None
    # Calls in progress at once, every caller and method together (more: RESOURCE_EXHAUSTED);
    # None: `default_max_concurrent_rpcs(max_requests)`.
    max_concurrent_rpcs: int | None = None
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

    def grpc_max_message_bytes(self, max_model_len: int) -> int:
        return self.max_message_bytes or default_max_message_bytes(max_model_len)

    def grpc_max_concurrent_rpcs(self) -> int:
        return self.max_concurrent_rpcs or default_max_concurrent_rpcs(self.max_requests)


# What a legitimate request to a worker can hold: prompt + resumed output are at most the
# context length in tokens, each id a varint of at most 5 bytes, and a prefill's destination
# at most one block id (5 bytes) per token; everything else (sampling parameters: stop
# strings, stop token ids, logit bias, a JSON schema) came from one client request the
# router took, at most its --max-request-bytes (1 MiB by default).
BYTES_PER_CONTEXT_TOKEN = 10
REQUEST_ALLOWANCE_BYTES = (1 << 20) + (64 << 10)  # the router's default limit + slack


def default_max_message_bytes(max_model_len: int) -> int:
    """The largest message a worker takes when not told: what a request for a context of
    `max_model_len` tokens can hold (about 1.1 MiB for 8k tokens, 2.3 MiB for 128k)."""
    return BYTES_PER_CONTEXT_TOKEN * max_model_len + REQUEST_ALLOWANCE_BYTES


def default_max_concurrent_rpcs(max_requests: int) -> int:
    """Calls a worker serves at once when not told: two per request it may hold (its
    AllocateRemote or Abort beside its stream) and 64 for Stats and health probes, so a
    worker's own limit (`max_requests`, UNAVAILABLE) always comes first."""
    return 2 * max_requests + 64
