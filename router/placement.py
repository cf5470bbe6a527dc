"""Placement: which decode worker (and prefill worker) serves a request, and whether its
prompt is prefilled there or on the prefill pool. No I/O: the router, the router-scale
benchmark (bench/router_scale.py) and tests call this same code.

Cache affinity comes from the router's KV index (router.kv_index), built from the workers'
KV events, so placing a request asks no worker anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.control.workers import WorkerInfo
from pdserve.engine.block_manager import block_hashes
from pdserve.types import LatencyClass
from router.cost import CostModel, decide_by_cost, local_estimate, remote_estimate
from router.kv_index import KVIndex
from router.policy import Decision, RouterPolicy, best_decode, decide_route

_NONE: Mapping[str, float] = {}


@dataclass(frozen=True)
class Placement:
    decode: WorkerInfo
    prefill: WorkerInfo | None
    decision: Decision
    cached_tokens: int  # of the prompt, on `decode`


def cached_tokens(index: KVIndex, ids: Sequence[int],
                  decoders: Sequence[WorkerInfo]) -> list[int]:
    """How many leading tokens of `ids` each decode worker holds. The prompt is hashed once
    per block geometry (block size, model); a worker the index has not synced counts as
    holding nothing."""
    matches: dict[tuple[int, str], dict[str, int]] = {}
    out = []
    for w in decoders:
        bs = index.block_size(w.worker_id)
        if bs is None:
            out.append(0)
            continue
        m = matches.get((bs, w.model_id))
        if m is None:
            m = matches[(bs, w.model_id)] = index.match(
                block_hashes(ids, bs, w.model_id.encode()))
        out.append(m.get(w.worker_id, 0) * bs)
    return out


def place(ids: Sequence[int], latency: LatencyClass, decoders: Sequence[WorkerInfo],
          prefills: Sequence[WorkerInfo], index: KVIndex, placed: Mapping[str, int],
          policy: RouterPolicy, *, cost: CostModel | None = None, target_s: float = 30.0,
          inflight_tokens: Mapping[str, float] = _NONE, tiebreak: int = 0) -> Placement:
    """`decoders` must not be empty. `placed`: requests this router placed per decode worker
    and not finished; heartbeats lag a burst by up to a second, so those count as running
    too, or a burst would all go to the worker that looked idlest at the last heartbeat.
    With `policy.placement == "cost"`, local vs remote (and the prefill worker) follow
    router.cost against `target_s` (the latency class's TTFT target); `inflight_tokens`:
    prompt tokens this router sent each worker to prefill that are not done yet; `tiebreak`:
    where equal scores start (the router advances it per request)."""
    cached = cached_tokens(index, ids, decoders)
    rows = [(c, max(w.load.running, placed.get(w.worker_id, 0)), w.load.backlog,
             w.load.free_blocks, w.load.total_blocks)
            for w, c in zip(decoders, cached, strict=True)]
    i = best_decode(rows, len(ids), policy, tiebreak)
    decode, best_cached = decoders[i], cached[i]
    if policy.placement == "cost":
        model = cost or CostModel()
        uncached = max(0, len(ids) - best_cached)
        local = local_estimate(decode.load, uncached, model,
                               inflight_tokens=inflight_tokens.get(decode.worker_id, 0.0))
        remotes = [(remote_estimate(p.load, decode.load, uncached, model,
                                    inflight_tokens=inflight_tokens.get(p.worker_id, 0.0)), p)
                   for p in prefills]
        remote, pick = min(remotes, key=lambda r: r[0].ttft_s) if remotes else (None, None)
        decision, _ = decide_by_cost(local, remote, uncached, target_s, model)
        return Placement(decode, pick, decision, best_cached)
    prefill = min(prefills, key=lambda w: (w.load.queued_tokens, w.load.running)
                  ) if prefills else None
    backlog = None if prefill is None else prefill.load.queued_tokens
    decision = decide_route(len(ids), best_cached, latency, backlog, policy)
    return Placement(decode, prefill, decision, best_cached)
