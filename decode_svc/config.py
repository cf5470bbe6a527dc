"""The decode worker's one config: every worker's settings (`WorkerConfig`) and the bounds on
KV blocks reserved for remote prefills. Its settings are `pdserve decode-worker`'s flags
(pdserve.settings). Light to import: the CLI builds its parser from it."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.settings import setting
from pdserve.worker_config import WorkerConfig

KV_LEASES = "remote prefill: KV blocks reserved for a transfer (bounds on what a caller pins)"


@dataclass(frozen=True)
class DecodeConfig(WorkerConfig):
    ucx_host: str = "127.0.0.1"  # the UCX address advertised (the listener binds `host`)
    alloc_lease_s: float = setting(
        30.0, "seconds reserved KV blocks wait for their transfer when the caller asks for no "
        "lease", flag="--alloc-lease", gt=0, group=KV_LEASES)
    max_alloc_lease_s: float = setting(
        120.0, "most seconds a caller may reserve KV blocks for (a longer lease asked for is "
        "cut to this)", flag="--max-alloc-lease", gt=0, group=KV_LEASES)
    max_kv_wait_s: float = setting(
        120.0, "most seconds a claimed reservation waits for its KV", gt=0, group=KV_LEASES)
    max_pending_kv_fraction: float = setting(
        0.5, "fraction of the KV pool that may wait for transfers (beyond: an allocation is "
        "UNAVAILABLE and the router prefills locally)", gt=0, le=1, group=KV_LEASES)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.alloc_lease_s > self.max_alloc_lease_s:
            raise ValueError(f"--alloc-lease ({self.alloc_lease_s:g} s) must not exceed "
                             f"--max-alloc-lease ({self.max_alloc_lease_s:g} s)")


__all__ = ["DecodeConfig"]
