"""The router's one validated config: `RouterProcessConfig` (listeners, keys, request limit,
drain) holding `RouterConfig` (placement, the stage timeouts, liveness probing, admission).

Every setting is a field here (or, for `RouterPolicy` and `AdmissionConfig`, a row of the
table on the field that holds them, with the default from their own dataclass): its flag's
name, default, help and range live once, and `pdserve router` / `pdserve cluster up` generate
their flags from them (pdserve.settings). A config built in code is checked the same way: an
out-of-range value is a ValueError naming the field and its flag.

Standard library only at import, so the CLI can build its parser from these classes; the
nested configs' modules are imported when a config is made.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.settings import Setting, check, nested, setting

if TYPE_CHECKING:
    from pdserve.rpc.auth import ClusterSecret
    from pdserve.rpc.tls import TLSConfig
    from pdserve.tenants import KeyPolicy
    from pdserve.types import LatencyClass
    from router.admission import AdmissionConfig
    from router.cost import CostModel
    from router.liveness import LivenessConfig
    from router.policy import RouterPolicy
    from router.remote import RemoteTimeouts

ROUTING = "routing (local vs remote prefill, worker choice)"
TIMEOUTS = "stage timeouts and retries (a request's path through the workers)"
LIVENESS = "worker liveness (lost and hung workers)"
ADMISSION = "admission (router.admission: refuse early what cannot be served in time)"
SERVER = "router process"


def _policy() -> RouterPolicy:
    from router.policy import RouterPolicy

    return RouterPolicy()


def _admission() -> AdmissionConfig:
    from router.admission import AdmissionConfig

    return AdmissionConfig()


def _cost() -> CostModel:
    from router.cost import CostModel

    return CostModel()


def _class_values(specs: list[str], what: str) -> dict[LatencyClass, float]:
    """CLASS=NUMBER items (`--class-share batch=0.5`) -> {LatencyClass: number}."""
    from pdserve.types import LatencyClass

    out: dict[LatencyClass, float] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        try:
            cls, number = LatencyClass(name.strip()), float(value)
        except ValueError:
            raise ValueError(f"expected CLASS={what} with CLASS one of "
                             f"{', '.join(c.value for c in LatencyClass)}, got {spec!r}") from None
        if not sep:
            raise ValueError(f"expected CLASS={what}, got {spec!r}")
        out[cls] = number
    return out


def _deadlines(specs: list[str]) -> Mapping[LatencyClass, float]:
    from router.admission import parse_deadlines

    return parse_deadlines(specs)


def _shares(specs: list[str]) -> Mapping[LatencyClass, float]:
    shares = _class_values(specs, "FRACTION")
    for cls, share in shares.items():
        if not 0 < share <= 1:
            raise ValueError(f"the share of {cls.value} must be in (0, 1], got {share:g}")
    return shares


def _weights(specs: list[str]) -> Mapping[LatencyClass, float]:
    weights = _class_values(specs, "WEIGHT")
    for cls, w in weights.items():
        if not (w > 0 and math.isfinite(w)):
            raise ValueError(f"the TTFT weight of {cls.value} must be > 0, got {w:g}")
    return weights


def _show_classes(table: Mapping[LatencyClass, float]) -> str:
    return " ".join(f"{cls.value}={value:g}" for cls, value in table.items())


# RouterPolicy (router.policy) fields that are flags; their defaults are RouterPolicy's.
POLICY_SETTINGS = {
    "remote_min_uncached_tokens": Setting(
        "uncached prompt tokens from which prefill goes to the prefill pool (--placement "
        "threshold)", flag="--remote-threshold", ge=0, group=ROUTING),
    "max_prefill_backlog_tokens": Setting(
        "prefill pool backlog (queued tokens) above which prefill stays local",
        flag="--max-prefill-backlog", ge=0, group=ROUTING),
    "batch_backlog_fraction": Setting(
        "batch requests skip the prefill pool above this fraction of --max-prefill-backlog "
        "(they yield to interactive ones first)", gt=0, le=1, group=ROUTING),
    "affinity_weight": Setting(
        "weight of prefix-cache affinity against load when picking a decode worker",
        ge=0, group=ROUTING),
    "placement": Setting(
        "local vs remote prefill: a fixed threshold on uncached tokens, or the predicted "
        "TTFT and decode stall from the workers' measured rates",
        choices=("threshold", "cost"), group=ROUTING),
    "ttft_targets_s": Setting(
        "first-token time a latency class aims for, repeatable (--placement cost: each "
        "second a candidate is predicted past it costs four more; capped by the class's "
        "--ttft-deadline)", flag="--ttft-target",
        metavar="CLASS=SECONDS", parse=_deadlines, show=_show_classes, group=ROUTING),
    "ttft_weights": Setting(
        "what a second of a latency class's first-token wait costs against a second of "
        "stall or TPOT on a running stream, repeatable (--placement cost; a lower weight "
        "makes the class wait for a prefill worker rather than stall a decode worker's "
        "streams)", flag="--ttft-weight", metavar="CLASS=WEIGHT", parse=_weights,
        show=_show_classes, group=ROUTING),
}

# AdmissionConfig (router.admission) fields that are flags; their defaults are its own.
ADMISSION_SETTINGS = {
    "enabled": Setting("admit everything (no in-flight cap, no early refusal)",
                       flag="--no-admission", negate=True, group=ADMISSION),
    "max_in_flight": Setting(
        "requests the router holds at once (admitted, not finished); more get HTTP 429 / "
        "RESOURCE_EXHAUSTED (each class may fill its --class-share of it: batch first)",
        ge=1, group=ADMISSION),
    "ttft_deadlines_s": Setting(
        "first-token deadline of a latency class, repeatable; a request predicted to miss "
        "it is refused early", flag="--ttft-deadline", metavar="CLASS=SECONDS",
        parse=_deadlines, show=_show_classes, group=ADMISSION),
    "class_share": Setting(
        "share of --max-in-flight a latency class may fill, repeatable (lower classes hit "
        "their cap first)", flag="--class-share", metavar="CLASS=FRACTION", parse=_shares,
        show=_show_classes, group=ADMISSION),
    "first_token_deadline_factor": Setting(
        "an admitted request with no first token by FACTOR x its class's deadline ends with "
        "a retryable 503 + Retry-After (1: the deadline itself, so a request is answered in "
        "time or refused; more lets late answers finish)", flag="--deadline-factor",
        metavar="FACTOR", gt=0, group=ADMISSION),
    "request_overhead_tokens": Setting(
        "prompt tokens every request is charged on top of its own (a short prompt still "
        "costs a pass)", flag="--admission-overhead-tokens", ge=0, group=ADMISSION),
    "initial_rate_tokens_per_s": Setting(
        "prompt tokens per second assumed before any worker measured its rate",
        flag="--admission-initial-rate", metavar="TOKENS/S", gt=0, group=ADMISSION),
    "min_rate_tokens_per_s": Setting(
        "floor of the predicted rate (tokens per second)", flag="--admission-min-rate",
        metavar="TOKENS/S", gt=0, group=ADMISSION),
    "rate_ewma_alpha": Setting(
        "weight of each observed first token in the rate's moving average",
        flag="--admission-rate-alpha", gt=0, le=1, group=ADMISSION),
    "min_samples": Setting(
        "first tokens observed before the observed rate replaces the workers' measured "
        "capacity", flag="--admission-min-samples", ge=0, group=ADMISSION),
    "min_retry_after_s": Setting("least Retry-After (seconds) of a refusal", ge=0,
                                 group=ADMISSION),
    "max_retry_after_s": Setting("most Retry-After (seconds) of a refusal", ge=1,
                                 group=ADMISSION),
}


@dataclass(frozen=True)
class RouterConfig:
    """What the router does with a request: where it goes, how long each stage may take,
    when a worker counts as lost, what is admitted."""

    policy: RouterPolicy = field(default_factory=_policy, metadata=nested(POLICY_SETTINGS))
    allocate_timeout_s: float = setting(
        5.0, "seconds a decode worker may take to reserve KV blocks for a remote prefill",
        gt=0, group=TIMEOUTS)
    prefill_timeout_s: float = setting(
        30.0, "seconds a remote prefill may take to land its first part of the KV, and "
        "each later part after the one before (the decode worker's lease on the reserved "
        "blocks, renewed by each part that lands)", gt=0, group=TIMEOUTS)
    max_prefill_timeout_s: float = setting(
        120.0, "seconds a remote prefill may take in all while its KV keeps landing; also "
        "the longest lease: where the prefill worker's queue, at its measured rate (or a "
        "peer's, or the cost model's slow prior), "
        "predicts longer than --prefill-timeout, the lease covers 1.5x the prediction, "
        "up to this (a decode worker caps leases at its own "
        "--max-alloc-lease, 120 s by default)", gt=0, group=TIMEOUTS)
    transfer_timeout_s: float = setting(
        30.0, "seconds the KV may take to arrive after its prefill (the decode worker "
        "waits --max-prefill-timeout + this in all)", gt=0, group=TIMEOUTS)
    first_token_timeout_s: float = setting(
        120.0, "seconds to a first token on a local prefill (a long prompt on a busy "
        "worker); admitted requests also stop at --deadline-factor x their deadline",
        gt=0, group=TIMEOUTS)
    token_timeout_s: float = setting(
        60.0, "seconds between two tokens of a running stream", gt=0, group=TIMEOUTS)
    max_decode_attempts: int = setting(
        2, "placements of a request before its first token", ge=1, group=TIMEOUTS)
    # A stream whose decode worker dies or hangs moves to another one, resuming after the
    # tokens the client has, at most this many times; then the request fails (503).
    max_migrations: int = setting(
        2, "moves of a running stream to another decode worker when its own is lost "
        "(then the request fails with 503)", ge=0, group=TIMEOUTS)
    # The stream's last token waits for it (it carries the timings): the prefill worker
    # replies as its KV is sent, about when the first token comes, so this bounds a late
    # reply only.
    prefill_report_wait_s: float = setting(
        0.1, "seconds a finished stream's last token waits for the prefill worker's stage "
        "timings", ge=0, group=TIMEOUTS)
    # A worker whose lease lapsed is probed once with this deadline: no answer means it is
    # dead or hung, and its requests move (a draining worker answers and keeps its streams).
    lost_probe_timeout_s: float = setting(
        2.0, "deadline of the health probe sent to a worker whose lease lapsed; no answer: "
        "lost, and its requests move", gt=0, group=LIVENESS)
    # A stream that gets nothing for this long has its worker probed (see above): a worker
    # that keeps its lease but does not answer is treated as lost too.
    stall_probe_s: float = setting(
        5.0, "seconds of silence on a stream after which its worker is probed",
        flag="--stall-probe-after", gt=0, group=LIVENESS)
    stall_probe_failures: int = setting(
        3, "probes in a row a registered worker must miss to count as lost", ge=1,
        group=LIVENESS)
    drain_grace_s: float = setting(
        300.0, "seconds streams on a worker that left (draining) may still finish",
        gt=0, group=LIVENESS)
    # While Redis is unreachable, route on the last known workers for at most this long.
    directory_max_staleness_s: float = setting(
        30.0, "seconds the router keeps routing on its last known workers while Redis is "
        "unreachable (then /health says not ready)", flag="--max-directory-staleness",
        gt=0, group=LIVENESS)
    directory_poll_s: float = setting(
        0.25, "seconds between two reads of the worker directory from Redis", gt=0,
        group=LIVENESS)
    # Router replicas on one Redis: each writes what it placed where and reads the others'
    # this often (pdserve.control.inflight), and pushes its counts to them as they move, so
    # that two do not send the same instant's arrivals to the same worker (the pushes do
    # that; the exchange renews the router's lease and brings what a push lost); a router
    # that stops writing drops out after 10 periods (at least 2 s), and a router that
    # cannot reach Redis goes on with its own counts.
    share_inflight_s: float = setting(
        0.2, "seconds between two exchanges of this router's in-flight counts with the "
        "other routers on the same Redis (0: none; each sees the others' requests only "
        "through the workers' heartbeats)", ge=0, group=ROUTING)
    # Cost placement's fixed cost of a remote prefill, corrected by the median miss of the
    # allocation + hand-off measured on the last this-many remote requests
    # (router.calibration); 0: the model's constant as it is.
    remote_overhead_window: int = setting(
        64, "remote requests whose measured allocation + hand-off correct cost placement's "
        "fixed cost of a remote prefill (their median; 0: no correction)", ge=0,
        group=ROUTING)
    admission: AdmissionConfig = field(default_factory=_admission,
                                      metadata=nested(ADMISSION_SETTINGS))
    cost: CostModel = field(default_factory=_cost)  # policy.placement == "cost"

    def __post_init__(self) -> None:
        check(self)
        adm = self.admission
        if adm.min_retry_after_s > adm.max_retry_after_s:
            raise ValueError(f"--min-retry-after ({adm.min_retry_after_s}) must not exceed "
                             f"--max-retry-after ({adm.max_retry_after_s})")

    def ttft_target_s(self, latency_class: LatencyClass) -> float:
        return self.policy.ttft_target_s(latency_class,
                                         self.admission.deadline_s(latency_class))

    @property
    def liveness(self) -> LivenessConfig:
        from router.liveness import LivenessConfig

        return LivenessConfig(lost_probe_timeout_s=self.lost_probe_timeout_s,
                              stall_probe_s=self.stall_probe_s,
                              stall_probe_failures=self.stall_probe_failures,
                              drain_grace_s=self.drain_grace_s)

    @property
    def remote(self) -> RemoteTimeouts:
        from router.remote import RemoteTimeouts

        return RemoteTimeouts(allocate_timeout_s=self.allocate_timeout_s,
                              prefill_timeout_s=self.prefill_timeout_s,
                              max_prefill_timeout_s=self.max_prefill_timeout_s,
                              transfer_timeout_s=self.transfer_timeout_s,
                              token_timeout_s=self.token_timeout_s,
                              prefill_report_wait_s=self.prefill_report_wait_s)


@dataclass(frozen=True)
class RouterProcessConfig:
    """The router process: its listeners, who may call it, its request limit, its drain."""

    redis_url: str
    model: str | None = None
    served_model_name: str | None = None  # None: the model directory's name
    namespace: str = "default"
    host: str = "127.0.0.1"
    grpc_port: int = setting(50051, "gRPC port (0: any free port)", flag="--port", ge=0,
                             le=65535, group=SERVER)
    http_port: int | None = setting(8000, "HTTP gateway port (0: any free port)", kind=int,
                                    ge=0, le=65535, group=SERVER)  # None: no HTTP gateway
    api_keys: frozenset[str] = frozenset()  # REST and the client gRPC API; empty: open
    # Tenant keys' policies (a keys file, pdserve.tenants); keys in `api_keys` without one
    # are operator keys (admin, no quota, any class).
    key_policies: Mapping[str, KeyPolicy] = field(default_factory=dict)
    cluster_secret: ClusterSecret | None = None  # sent to the workers; None: none, warned
    metrics_require_auth: bool = setting(
        False, "ask for an API key on /metrics too (default: open to scrapers)", group=SERVER)
    # The largest request either API takes: an HTTP body (else 413) or a gRPC message (else
    # RESOURCE_EXHAUSTED), so a prompt too big for one is too big for the other.
    max_request_bytes: int = setting(
        1 << 20, "largest HTTP request body (else 413) and gRPC request message (else "
        "RESOURCE_EXHAUSTED)", ge=1, group=SERVER)
    # Local requests to a decode worker ride one long-lived Session call per worker (no
    # call set up per request: router.clients); off, each is a Generate call of its own.
    worker_sessions: bool = setting(
        True, "send each decode worker's local requests as Generate calls of their own, "
        "not as messages on one Session call", flag="--no-worker-sessions", negate=True,
        group=SERVER)
    # Who serves the client-facing gRPC API: grpc.aio ("python"), or the compiled data plane
    # (router/_dataplane.cc, router.dataplane): grpc++ moves a local route's bytes, client to
    # worker and every token back, with Python still making each decision; the rest is relayed
    # to the grpc.aio server on a loopback port. Needs the extension built (grpc++ headers).
    data_plane: str = setting(
        "python", "who serves the gRPC API: grpc.aio, or the compiled data plane (grpc++ "
        "relays local routes, Python decides)", choices=("python", "compiled"), group=SERVER)
    router: RouterConfig = field(default_factory=RouterConfig, metadata=nested())
    drain_timeout_s: float = setting(
        30.0, "seconds a stopping router lets in-flight requests finish", ge=0, group=SERVER)
    # TLS on both APIs (client certificates as tls.client_auth says) and mTLS to the
    # workers; None: plaintext everywhere.
    tls: TLSConfig | None = None

    def __post_init__(self) -> None:
        check(self)


__all__ = ["ADMISSION_SETTINGS", "POLICY_SETTINGS", "RouterConfig", "RouterProcessConfig"]
