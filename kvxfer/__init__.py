"""KV block transfer between prefill and decode pools over UCX (see kvxfer.protocol)."""

from pdserve.kvxfer.pool import PoolBytes
from pdserve.kvxfer.protocol import Code
from pdserve.kvxfer.receiver import Expectation, KVReceiver
from pdserve.kvxfer.runs import expand_runs, merge_pairs, merge_runs
from pdserve.kvxfer.sender import DescriptorResolver, KVSender, SendResult

__all__ = [
    "Code",
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
