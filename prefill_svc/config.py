"""The prefill worker's one config: every worker's settings (`WorkerConfig`), how many
prefills it runs at once and how long a KV transfer may take. Its settings are `pdserve
prefill-worker`'s flags (pdserve.settings). Light to import: the CLI builds its parser from
it."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.settings import setting
from pdserve.worker_config import WorkerConfig


@dataclass(frozen=True)
class PrefillConfig(WorkerConfig):
    # Not the worker's `max_requests` (what it holds) nor the router's `max_in_flight` (what
    # it admits): prefills computing or transferring at once; the rest wait their turn.
    max_concurrent_prefills: int = setting(
        4, "prefills computing or sending their KV at once; more requests queue, the more "
        "urgent latency class first", ge=1)
    transfer_timeout_s: float = setting(
        30.0, "seconds a KV transfer to a decode worker may take", gt=0)
    kv_overlap: bool = setting(
        True, "send a remote prefill's KV only once the whole prompt computed (default: each "
        "computed chunk's blocks go to the decode worker while the next chunk computes)",
        flag="--no-kv-overlap", negate=True)


__all__ = ["PrefillConfig"]
