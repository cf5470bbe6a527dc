"""Settings every worker process has, whatever its role. Fields made with `setting()` are the
workers' flags (pdserve.settings): name, default, help and range live here once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.config import EngineConfig
from pdserve.settings import check, setting

if TYPE_CHECKING:
    import grpc

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
    port: int = setting(0, "gRPC port (0: any free port)", ge=0, le=65535)
    advertise_host: str = ""  # how other processes reach us; "": `host`
    metrics_port: int = setting(0, "Prometheus /metrics HTTP port (0: any free port, -1: off)",
                                ge=-1, le=65535)
    namespace: str = "default"
    lease_ttl_s: float = setting(3.0, "seconds the worker stays listed in the registry after "
                                 "its last heartbeat (routers drop it then)", flag="--lease-ttl",
                                 gt=0)
    heartbeat_s: float = setting(1.0, "seconds between heartbeats (lease renewal and load "
                                 "record); less than --lease-ttl", gt=0)
    drain_timeout_s: float = setting(60.0, "seconds a stopping worker lets in-flight work "
                                     "finish (keep the orchestrator's stop grace period above "
                                     "it)", ge=0)
    # Requests the worker holds at most (queued, running, awaiting KV); more are refused with
    # UNAVAILABLE so the router goes elsewhere: a worker's memory stays bounded.
    max_requests: int = setting(256, "requests this worker holds at most (queued, running, "
                                "awaiting KV); more are refused with UNAVAILABLE and the router "
                                "goes elsewhere", ge=1)
    # Bounds on the gRPC server, whoever calls (docs/RELIABILITY.md, Security). The largest
    # request message; None: `default_max_message_bytes` of the model's context length.
    max_message_bytes: int | None = setting(
        None, "largest gRPC request message, else RESOURCE_EXHAUSTED (default: what a request "
        "for the model's whole context can hold: 10 bytes a token + 1 MiB 64 KiB; keep it "
        "above the router's --max-request-bytes)", kind=int, ge=1)
    # Calls in progress at once, every caller and method together (more: RESOURCE_EXHAUSTED);
    # None: `default_max_concurrent_rpcs(max_requests)`.
    max_concurrent_rpcs: int | None = setting(
        None, "gRPC calls in progress at once, all callers together, else RESOURCE_EXHAUSTED "
        "(default: 2 x --max-requests + 64)", kind=int, ge=1)
    # Authenticates gRPC callers and KV writes (pdserve.rpc.auth); None: open, with a warning.
    cluster_secret: ClusterSecret | None = None
    # TLS on the gRPC and metrics listeners, a client certificate from its CA required
    # (pdserve.rpc.tls); None: plaintext.
    tls: TLSConfig | None = None
    kv_shm: bool = setting(True, "move KV over UCX even to and from workers on this host "
                           "(default: through a shared-memory staging ring where detected, "
                           "kvxfer.shm)", flag="--no-kv-shm", negate=True)

    def __post_init__(self) -> None:
        check(self)
        if self.heartbeat_s >= self.lease_ttl_s:
            raise ValueError(f"--heartbeat ({self.heartbeat_s:g} s) must be less than "
                             f"--lease-ttl ({self.lease_ttl_s:g} s), or the lease lapses "
                             "between heartbeats")

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
    """Calls a worker serves at once when not told: two per request it may hold (an
    Abort beside its stream) and 64 for Stats and health probes, so a
    worker's own limit (`max_requests`, UNAVAILABLE) always comes first."""
    return 2 * max_requests + 64
