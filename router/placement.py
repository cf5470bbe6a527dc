"""Placement: which decode worker (and prefill worker) serves a request, and whether its
prompt is prefilled there or on the prefill pool. No I/O: the router, the router-scale
benchmark (bench/router_scale.py) and tests call this same code.

Cache affinity comes from the router's KV index (router.kv_index), built from the workers'
KV events, so placing a request asks no worker anything.

The router places every request, so this is its hot path (bench/router_scale.py measures
it): the prompt is hashed only as far as some worker holds it (in C where built), and the
decode workers are scored as arrays (`DecodeTable`, rebuilt only when a heartbeat or the
candidate list changes) with exactly the arithmetic and tie-breaking of
`router.policy.best_decode`, the reference the tests hold it to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import numpy.typing as npt

from pdserve.control.workers import WorkerInfo
from pdserve.types import LatencyClass
from router.cost import CostModel, decide_by_cost, local_estimate, remote_estimate
from router.kv_index import KVIndex
from router.policy import Decision, RouterPolicy, decide_route

_NONE: Mapping[str, float] = {}
Floats = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Placement:
    decode: WorkerInfo
    prefill: WorkerInfo | None
    decision: Decision
    cached_tokens: int  # of the prompt, on `decode`


@dataclass(frozen=True)
class _Columns:
    """One candidate list's load columns, position = index in the list."""

    workers: tuple[WorkerInfo, ...]  # held: the cache key is their ids
    ids: tuple[str, ...]
    pos: dict[str, int]
    running: Floats
    waiting: Floats
    memory: Floats  # 0.5 * free / total blocks (0 without a pool): best_decode's memory term
    # Per block geometry (block size, model id) the index knows: the positions in it.
    groups: tuple[tuple[int, bytes, frozenset[int]], ...]


class DecodeTable:
    """The decode candidates as arrays, cached across requests. The router filters its
    directory per request, but the WorkerInfo objects only change with a heartbeat (they are
    immutable), so the columns are rebuilt only when the list holds other objects, or the
    index learned another worker's block size."""

    def __init__(self) -> None:
        self._key: tuple[int, ...] = ()
        self._cols: _Columns | None = None
        self._index: KVIndex | None = None
        self._version = -1

    def columns(self, decoders: Sequence[WorkerInfo], index: KVIndex) -> _Columns:
        key = tuple(map(id, decoders))
        cols = self._cols
        if (cols is None or key != self._key or index is not self._index
                or index.geometry_version != self._version):
            cols = self._cols = _build(decoders, index)
            self._key, self._index, self._version = key, index, index.geometry_version
        return cols


def _build(decoders: Sequence[WorkerInfo], index: KVIndex) -> _Columns:
    ids = tuple(w.worker_id for w in decoders)
    free = np.array([w.load.free_blocks for w in decoders], dtype=np.float64)
    total = np.array([w.load.total_blocks for w in decoders], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        memory = np.where(total != 0, 0.5 * free / np.where(total != 0, total, 1.0), 0.0)
    geometry = index.geometry()
    members: dict[tuple[int, bytes], set[int]] = {}
    for i, w in enumerate(decoders):
        bs = geometry.get(w.worker_id)
        if bs is not None:
            members.setdefault((bs, w.model_id.encode()), set()).add(i)
    return _Columns(
        workers=tuple(decoders), ids=ids, pos={w: i for i, w in enumerate(ids)},
        running=np.array([w.load.running for w in decoders], dtype=np.float64),
        waiting=np.array([w.load.backlog for w in decoders], dtype=np.float64),
        memory=memory,
        groups=tuple((bs, extra, frozenset(m)) for (bs, extra), m in members.items()))


def _cached(index: KVIndex, ids: Sequence[int], cols: _Columns) -> Floats:
    """Prompt tokens each candidate holds: one walk per block geometry; a worker the index
    has not synced holds nothing."""
    cached = np.zeros(len(cols.ids))
    for bs, extra, members in cols.groups:
        for worker_id, depth in index.match_prompt(ids, bs, extra).items():
            i = cols.pos.get(worker_id)
            if i is not None and i in members:
                cached[i] = depth * bs
    return cached


def cached_tokens(index: KVIndex, ids: Sequence[int],
                  decoders: Sequence[WorkerInfo]) -> list[int]:
    """How many leading tokens of `ids` each decode worker holds."""
    return [int(c) for c in _cached(index, ids, _build(decoders, index))]


def best_of(cols: _Columns, cached: Floats, placed: Mapping[str, int], prompt_len: int,
            policy: RouterPolicy, tiebreak: int = 0) -> int:
    """`router.policy.best_decode` over the columns (the same floats in the same order, the
    same first-from-`tiebreak` choice among equal scores), with `placed` counted as running."""
    n = len(cols.ids)
    running = cols.running
    if placed:
        running = np.maximum(running, np.fromiter(
            map(placed.get, cols.ids, repeat(0)), dtype=np.float64, count=n))
    load = running + cols.waiting
    max_load = float(load.max()) or 1.0
    weight = policy.affinity_weight / max(prompt_len, 1)
    score = weight * cached - load / max_load + cols.memory
    ties = np.flatnonzero(score == score.max())  # ascending positions of the best score
    k = int(np.searchsorted(ties, tiebreak % n))  # the first at or after `tiebreak`...
    return int(ties[k if k < len(ties) else 0])  # ...or, past the end, the first one


def least_backlog(prefills: Sequence[WorkerInfo], inflight_tokens: Mapping[str, float],
                  tiebreak: int = 0) -> WorkerInfo | None:
    """The prefill worker with the least queued prompt work: its last heartbeat's queued
    tokens, or what this router sent it since if that is more (a burst between heartbeats
    would otherwise all go to the same one), then fewest running; equal ones take turns from
    position `tiebreak`. bench.cluster_sim found the heartbeat-only choice herding batch
    prompts onto the first prefill workers at 64 decode workers."""
    if not prefills:
        return None
    n = len(prefills)
    start = tiebreak % n
    order = [prefills[(start + k) % n] for k in range(n)]
    return min(order, key=lambda w: (max(w.load.queued_tokens,
                                         inflight_tokens.get(w.worker_id, 0.0)),
                                     w.load.running))


def place(ids: Sequence[int], latency: LatencyClass, decoders: Sequence[WorkerInfo],
          prefills: Sequence[WorkerInfo], index: KVIndex, placed: Mapping[str, int],
          policy: RouterPolicy, *, cost: CostModel | None = None, target_s: float = 30.0,
          inflight_tokens: Mapping[str, float] = _NONE, tiebreak: int = 0,
          table: DecodeTable | None = None) -> Placement:
    """`decoders` must not be empty. `placed`: requests this router placed per decode worker
    and not finished; heartbeats lag a burst by up to a second, so those count as running
    too, or a burst would all go to the worker that looked idlest at the last heartbeat.
    With `policy.placement == "cost"`, local vs remote (and the prefill worker) follow
    router.cost against `target_s` (the latency class's TTFT target); `inflight_tokens`:
    prompt tokens this router sent each worker to prefill that are not done yet; `tiebreak`:
    where equal scores start (the router advances it per request); `table`: the caller's
    DecodeTable, kept across calls (without one, the columns are built for this call)."""
    cols = (table or DecodeTable()).columns(decoders, index)
    cached = _cached(index, ids, cols)
    i = best_of(cols, cached, placed, len(ids), policy, tiebreak)
    decode, best_cached = decoders[i], int(cached[i])
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
    prefill = least_backlog(prefills, inflight_tokens, tiebreak)
    backlog = None if prefill is None else prefill.load.queued_tokens
    decision = decide_route(len(ids), best_cached, latency, backlog, policy)
    return Placement(decode, prefill, decision, best_cached)
