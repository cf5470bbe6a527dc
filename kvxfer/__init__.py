"""KV block transfer between prefill and decode pools over UCX (see kvxfer.protocol)."""
# ruff: noqa: E402 (the preload comes first)

# Before anything loads ucxx: UCX listeners bind the configured host (kvxfer.listen).
from kvxfer import listen as _listen

_listen.preload()

from kvxfer.pool import PoolBytes
from kvxfer.receiver import Expectation, KVReceiver
from kvxfer.runs import expand_runs, merge_pairs, merge_runs
from kvxfer.sender import DescriptorResolver, KVSender, SendResult

__all__ = [
    "DescriptorResolver",
    "Expectation",
    "KVReceiver",
    "KVSender",
    "PoolBytes",
    "SendResult",
    "expand_runs",
    "merge_pairs",
    "merge_runs",
]
