"""KV block transfer between prefill and decode pools over UCX (see kvxfer.protocol)."""
# ruff: noqa: E402 (the preload comes first)

# Before anything loads ucxx: UCX listeners bind the configured host (kvxfer.listen).
from kvxfer import listen as _listen

_listen.preload()

from kvxfer import progress as _progress
from kvxfer.pool import PoolBytes
from kvxfer.receiver import Expectation, KVReceiver
from kvxfer.runs import expand_runs, merge_pairs, merge_runs
from kvxfer.sender import DescriptorResolver, KVSender, SendResult

_progress.install()  # ucxx's progress thread: 100 ms between idle wake-ups, not 1 (see there)

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
