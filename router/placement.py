"""Placement: which decode worker (and prefill worker) serves a request, and whether its
prompt is prefilled there or on the prefill pool. No I/O: the router, the router-scale
benchmark (bench/router_scale.py) and tests call this same code.

Cache affinity comes from the router's KV index (router.kv_index), built from the decode and
prefill workers' KV events, so placing a request asks no worker anything: one walk over the
prompt's hashes tells how much of it every worker of either role holds.

Two policies (`RouterPolicy.placement`): *threshold* picks the decode worker by a weighted
load + affinity score (`best_of`) and goes remote when enough of the prompt is uncached there;
*cost* predicts the TTFT of every candidate, local on each decode worker or remote on each
(prefill, decode) pair, from the workers' measured rates and the tokens each one lacks
(router.cost), and takes the cheapest, time past the class's target priced (`best_by_cost`).

The router places every request, so this is its hot path (bench/router_scale.py measures
it): the prompt is hashed only as far as some worker holds it (in C where built), and the
decode workers are scored as arrays (`DecodeTable`, rebuilt only when a heartbeat or the
candidate list changes) with exactly the arithmetic and tie-breaking of
`router.policy.best_decode`, the reference the tests hold it to.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pdserve.control.load import WorkerLoad
from pdserve.control.workers import WorkerInfo
from pdserve.engine.free_cpus import BUSY_MARGIN, LONG_STEP_TOKENS
from pdserve.types import LatencyClass
from router.cost import CostModel
from router.kv_index import KVIndex, spread
from router.policy import Decision, Route, RouterPolicy, decide_route

if TYPE_CHECKING:
    from router._score import CostTable

_NONE: Mapping[str, float] = {}
_DEFAULT_COST = CostModel()
Floats = npt.NDArray[np.float64]
_native_best: Callable[..., int] | None
_native_cost: Callable[..., tuple[int, int, bool, float, float]] | None
_NativeTable: Callable[..., CostTable] | None
try:  # router/_score.c, where setup.py could build it: best_of's and best_by_cost's
    # arithmetic in C loops, and best_by_cost's candidates held across decisions
    from router._score import CostTable as _NativeTable
    from router._score import best as _native_best
    from router._score import best_cost as _native_cost
except ImportError:  # pragma: no cover - the numpy paths below give the same choices
    _native_best = _native_cost = _NativeTable = None


@dataclass(frozen=True)
class Placement:
    decode: WorkerInfo
    prefill: WorkerInfo | None
    decision: Decision
    cached_tokens: int  # of the prompt, on `decode`


# Where a worker computes: host id, CPUs, nice value, threads, whether it adapts them.
_Host = tuple[str, tuple[int, ...], int, int, bool]


@dataclass(frozen=True)
class _Columns:
    """One candidate list's load columns, position = index in the list."""

    workers: tuple[WorkerInfo, ...]  # held: the cache key is their ids
    ids: tuple[str, ...]
    running: Floats
    waiting: Floats
    memory: Floats  # 0.5 * free / total blocks (0 without a pool): best_decode's memory term
    # The cost model's inputs as published (0: not measured; router.cost substitutes priors).
    rate: Floats  # prefill tokens/s
    step: Floats  # decode step seconds
    prompt_waiting: Floats  # prompt tokens the engine has still to prefill
    queued_tokens: Floats  # prompt tokens queued before the engine (prefill workers)
    transfer: Floats  # KV transfer seconds per token (prefill workers)
    cpu_share: Floats  # of its CPUs while it measured its prefill rate (0: not published)
    # Per block geometry (block size, model id) the index knows: index slot -> position of
    # that worker here (-1: none; `KVIndex.slot`, held while the index's geometry is).
    groups: tuple[tuple[int, bytes, npt.NDArray[np.intp]], ...]
    min_rate: float  # the slowest measured prefill rate (inf: none measured)
    # Per position: where it computes as published (`_host`), for `DecodeTable.shares`.
    hosts: tuple[_Host, ...]
    # Per cost model and peer rate: the columns above with the peer rate or the model's
    # priors in place of what was not measured (computed once per table and peer rate).
    # Keyed by the model's identity (hashing its fields costs more than a lookup), the model
    # held beside its prices so that no other model can take its id.
    priced: dict[tuple[int, float | None], tuple[CostModel, _Priced]] = field(
        default_factory=dict, compare=False)

    def prices(self, model: CostModel, peer_rate: float | None = None) -> _Priced:
        """`peer_rate`: router.cost.peer_prefill_rate over every candidate, both roles."""
        held = self.priced.get((id(model), peer_rate))
        if held is not None and held[0] is model:
            return held[1]
        got = _Priced(
            rate=np.where(self.rate != 0, self.rate, peer_rate or model.prior_prefill_tokens_per_s),
            step=np.where(self.step != 0, self.step, model.prior_decode_step_s),
            transfer=np.where(self.transfer != 0, self.transfer, model.prior_transfer_s_per_token),
            queued=self.queued_tokens + self.prompt_waiting)
        self.priced[id(model), peer_rate] = (model, got)
        return got


@dataclass(frozen=True)
class _Priced:
    rate: Floats
    step: Floats
    transfer: Floats
    queued: Floats  # queued + waiting prompt tokens (a prefill worker's backlog)


class _Cached:
    """One candidate list's columns, rebuilt only when the list holds other objects or the
    index learned another worker's block size. A heartbeat replaces one worker's record:
    only its row is rewritten (64 heartbeats a second at 64 workers would otherwise rebuild
    every column several times a second). A caller that names its list (`listing`) is
    answered by that name alone while it holds: no pass over the workers per request."""

    def __init__(self) -> None:
        self._key: tuple[int, ...] = ()
        self._cols: _Columns | None = None
        self._index: KVIndex | None = None
        self._version = -1
        self._listing: object = None

    def get(self, workers: Sequence[WorkerInfo], index: KVIndex,
            listing: object = None) -> _Columns:
        cols = self._cols
        if listing is not None and listing == self._listing and cols is not None \
                and index is self._index and index.geometry_version == self._version:
            return cols
        key = tuple(map(id, workers))
        if cols is not None and key == self._key and index is self._index \
                and index.geometry_version == self._version:
            self._listing = listing
            return cols
        if (cols is not None and len(key) == len(self._key) and index is self._index
                and index.geometry_version == self._version):
            changed = [i for i, (a, b) in enumerate(zip(key, self._key, strict=True)) if a != b]
            if len(changed) * 4 <= len(key):
                cols = _update_rows(cols, workers, changed)
        if cols is None or cols is self._cols:
            cols = _build(workers, index)
        self._cols, self._key, self._index, self._version, self._listing = (
            cols, key, index, index.geometry_version, listing)
        return cols


class DecodeTable:
    """The candidates as arrays, cached across requests: decode workers, and prefill workers
    for cost placement. The router filters its directory per request, but the WorkerInfo
    objects only change with a heartbeat (they are immutable), so the columns are rebuilt
    only when a list holds other objects, or the index learned another worker's block size."""

    def __init__(self) -> None:
        self._decode = _Cached()
        self._prefill = _Cached()
        self._shares: tuple[object, object, Floats | None, _Beside | None] = (
            None, None, None, None)
        self._fast: tuple[object, object, object, _Fast | None] = (None, None, None, None)

    def columns(self, decoders: Sequence[WorkerInfo], index: KVIndex,
                listing: object = None) -> _Columns:
        return self._decode.get(decoders, index, listing)

    def prefill_columns(self, prefills: Sequence[WorkerInfo], index: KVIndex,
                        listing: object = None) -> _Columns:
        return self._prefill.get(prefills, index, listing)

    def shares(self, dcols: _Columns, pcols: _Columns) -> Floats | None:
        """[prefill position, decode position] -> how much the prefill worker's compute
        stalls the decode worker's streams (`WorkerInfo.stall_share`: 0 where they do not
        compete for CPUs); None where no pair does. Recomputed only when either
        list's placements change: a heartbeat keeps its row's hosts tuple, and a rebuild
        with the same placements is compared once, then held by identity again."""
        return self._placements(dcols, pcols)[2]

    def beside(self, dcols: _Columns, pcols: _Columns) -> _Beside | None:
        """Which decode workers compete for each prefill worker's CPUs, and the share of a
        CPU it gets beside each (`_Beside`); None where none do. Held like `shares`."""
        return self._placements(dcols, pcols)[3]

    def fast_cost(self, dcols: _Columns, pcols: _Columns, model: CostModel) -> _Fast | None:
        """`best_by_cost`'s candidates in C, held while these columns and this model are
        (`_fast_cost`); None where that path does not apply."""
        d, p, mod, fast = self._fast
        if d is dcols and p is pcols and mod is model:
            return fast
        fast = None
        if _NativeTable is not None and self.shares(dcols, pcols) is None \
                and self.beside(dcols, pcols) is None:
            fast = _fast_cost(dcols, pcols, model)
        self._fast = (dcols, pcols, model, fast)
        return fast

    def _placements(self, dcols: _Columns, pcols: _Columns
                    ) -> tuple[object, object, Floats | None, _Beside | None]:
        d, p, _, _ = held = self._shares
        if d is not dcols.hosts or p is not pcols.hosts:
            if d != dcols.hosts or p != pcols.hosts:
                held = (dcols.hosts, pcols.hosts, shares_matrix(pcols.workers, dcols.workers),
                        _beside(pcols.workers, dcols.workers))
            self._shares = held = (dcols.hosts, pcols.hosts, held[2], held[3])
        return held


@dataclass(frozen=True)
class _Fast:
    """`best_by_cost` over two candidate lists in one C call per decision (router/_score.c's
    CostTable: the priced columns copied in once), where no prefill worker shares a decode
    worker's CPUs and both lists sit in one block geometry. A decision with its caches cold
    (as the router's are between requests) spends about a third less than through the
    columns' numpy arrays (bench/router_scale.py --placement cost --cold-kib 4096:
    docs/bench/dataplane_s78)."""

    table: CostTable
    geometry: tuple[int, bytes] | None  # (block size, extra) of the walk; None: no walk


def _prices(dcols: _Columns, pcols: _Columns, model: CostModel) -> tuple[_Priced, _Priced]:
    """Both lists' columns as `model` prices them, with the slowest measured prefill rate of
    either (router.cost.peer_prefill_rate) for the rates not measured."""
    peer = min(dcols.min_rate, pcols.min_rate)
    peer_rate = None if peer == np.inf else peer
    return dcols.prices(model, peer_rate), pcols.prices(model, peer_rate)


def _fast_cost(dcols: _Columns, pcols: _Columns, model: CostModel) -> _Fast | None:
    keys = {(bs, extra) for bs, extra, _ in (*dcols.groups, *pcols.groups)}
    if _NativeTable is None or len(keys) > 1 or len(dcols.groups) > 1 or len(pcols.groups) > 1:
        return None
    dp, pp = _prices(dcols, pcols, model)
    none = np.zeros(0, dtype=np.intp)
    table = _NativeTable(
        dcols.running, dcols.prompt_waiting, dp.rate, dp.step, dcols.ids,
        dcols.groups[0][2] if dcols.groups else none, pp.queued, pp.rate, pp.transfer,
        pcols.ids, pcols.groups[0][2] if pcols.groups else none, float(model.absorbed_tokens),
        model.decode_row_fraction, model.stall_weight, model.tpot_weight, model.late_weight,
        model.remote_overhead_s, model.max_local_prefill_s)
    return _Fast(table, keys.pop() if keys else None)


@dataclass(frozen=True)
class _Beside:
    """Per [prefill, decode] position: whether they compete for CPUs, the share of a CPU
    the prefill worker gets beside that decode worker busy (`WorkerInfo.cpu_share_beside`),
    and how many of its CPUs that one computes on (`WorkerInfo.cpus_shared`); per prefill
    position, how many CPUs it may run on (0: unknown), its threads (`WorkerInfo.threads`;
    0: one per CPU) and whether it adapts them (`WorkerInfo.adapt_threads`)."""

    competes: npt.NDArray[np.bool_]
    share: Floats
    taken: Floats
    cpus: Floats
    threads: Floats
    adapt: npt.NDArray[np.bool_]


def _beside(prefills: Sequence[WorkerInfo], decoders: Sequence[WorkerInfo]) -> _Beside | None:
    shape = (len(prefills), len(decoders))
    competes = np.array([[p.shares_cpus(d) for d in decoders] for p in prefills],
                        dtype=bool).reshape(shape)
    adapt = np.array([p.adapt_threads and bool(p.cpus) for p in prefills], dtype=bool)
    if not competes.any() and not adapt.any():
        return None
    share = np.array([[p.cpu_share_beside(d) for d in decoders] for p in prefills],
                     dtype=float).reshape(shape)
    taken = np.array([[p.cpus_shared(d) for d in decoders] for p in prefills],
                     dtype=float).reshape(shape)
    return _Beside(competes, share, taken,
                   np.array([len(p.cpus) for p in prefills], dtype=float),
                   np.array([p.threads for p in prefills], dtype=float), adapt)


def cpu_factors(beside: _Beside, pcols: _Columns, busy: npt.NDArray[np.bool_],
                long_prompt: bool = True) -> Floats:
    """router.cost.cpu_factor for every prefill worker at once: `busy`, per decode position,
    whether it computes now (streams running or prompt work pending); `long_prompt`: the
    prompt has `LONG_STEP_TOKENS` or more."""
    mask = beside.competes & busy[None, :]
    most = np.where(beside.threads > 0, beside.threads, np.maximum(beside.cpus, 1.0))
    free = beside.cpus - np.minimum(np.where(mask, beside.taken, 0.0).sum(axis=1),
                                    beside.cpus)
    best = np.where(mask, beside.share, 0.0).max(axis=1, initial=0.0)
    adapted = (np.maximum(1.0, np.minimum(most, np.floor(free + BUSY_MARGIN)))
               if long_prompt else np.ones_like(most))
    n = np.where(beside.adapt, adapted, most)
    have = np.where(free > 0, np.minimum(n, free), best)
    measured = np.where(pcols.cpu_share > 0, pcols.cpu_share, 1.0)
    factor = have / (most * measured)
    return np.where((beside.cpus > 0) & (mask.any(axis=1) | beside.adapt),
                    np.where(beside.adapt, factor, np.minimum(1.0, factor)), 1.0)


def shares_matrix(prefills: Sequence[WorkerInfo], decoders: Sequence[WorkerInfo]
                  ) -> Floats | None:
    """`DecodeTable.shares` computed."""
    matrix = np.array([[p.stall_share(d) for d in decoders] for p in prefills],
                      dtype=float).reshape(len(prefills), len(decoders))
    return matrix if matrix.any() else None


def _build(decoders: Sequence[WorkerInfo], index: KVIndex) -> _Columns:
    """Columns of any role's candidates (the prefill-only ones stay 0 on decode workers)."""
    ids = tuple(w.worker_id for w in decoders)
    rows = np.array([_row(w.load) for w in decoders], dtype=np.float64).reshape(
        len(decoders), len(_FLOAT_COLUMNS))
    (running, waiting, memory, rate, step, prompt_waiting, queued_tokens, transfer,
     cpu_share) = (np.ascontiguousarray(rows[:, k]) for k in range(len(_FLOAT_COLUMNS)))
    geometry = index.geometry()
    members: dict[tuple[int, bytes], dict[int, int]] = {}  # slot -> position
    for i, w in enumerate(decoders):
        bs, slot = geometry.get(w.worker_id), index.slot(w.worker_id)
        if bs is not None and slot is not None:
            members.setdefault((bs, w.model_id.encode()), {})[slot] = i
    return _Columns(
        workers=tuple(decoders), ids=ids,
        running=running, waiting=waiting, memory=memory, rate=rate, step=step,
        prompt_waiting=prompt_waiting, queued_tokens=queued_tokens, transfer=transfer,
        cpu_share=cpu_share, min_rate=float(rate[rate != 0].min()) if rate.any() else np.inf,
        groups=tuple((bs, extra, _positions(m)) for (bs, extra), m in members.items()),
        hosts=tuple(_host(w) for w in decoders))


def _host(w: WorkerInfo) -> _Host:
    """Where a worker computes, as placement prices sharing (`DecodeTable.beside`)."""
    return (w.host_id, w.cpus, w.nice, w.threads, w.adapt_threads)


def _positions(members: Mapping[int, int]) -> npt.NDArray[np.intp]:
    """index slot -> position (-1: not one of these candidates)."""
    positions = np.full(max(members) + 1, -1, dtype=np.intp)
    for slot, i in members.items():
        positions[slot] = i
    return positions


def _row(load: WorkerLoad) -> tuple[float, ...]:
    """One worker's values in `_Columns`' float columns (in `_FLOAT_COLUMNS` order)."""
    total = load.total_blocks
    return (float(load.running), float(load.backlog),
            0.5 * load.free_blocks / total if total else 0.0,
            load.prefill_tokens_per_s or 0.0, load.decode_step_s or 0.0,
            load.waiting_prompt_tokens or 0.0, load.queued_tokens or 0.0,
            load.kv_transfer_s_per_token or 0.0, load.prefill_cpu_share or 0.0)


_FLOAT_COLUMNS = ("running", "waiting", "memory", "rate", "step", "prompt_waiting",
                  "queued_tokens", "transfer", "cpu_share")


def _update_rows(cols: _Columns, workers: Sequence[WorkerInfo], changed: list[int]
                 ) -> _Columns | None:
    """`cols` with the rows at `changed` taken from `workers` (new columns: a caller may
    still hold the old ones), or None where a row is another worker or changes the block
    geometry (then everything is rebuilt)."""
    for i in changed:
        if workers[i].worker_id != cols.ids[i] \
                or workers[i].model_id != cols.workers[i].model_id \
                or _host(workers[i]) != cols.hosts[i]:
            return None
    arrays = {name: getattr(cols, name).copy() for name in _FLOAT_COLUMNS}
    for i in changed:
        for name, value in zip(_FLOAT_COLUMNS, _row(workers[i].load), strict=True):
            arrays[name][i] = value
    rate = arrays["rate"]
    return dataclasses.replace(
        cols, workers=tuple(workers), priced={},
        min_rate=float(rate[rate != 0].min()) if rate.any() else np.inf, **arrays)


def _cached(index: KVIndex, ids: Sequence[int], *colsets: _Columns) -> list[Floats]:
    """Prompt tokens each candidate of each list holds: one walk per block geometry, shared
    by the lists (decode and prefill workers sit in one index), written into the list's
    positions by slot in one call (`kv_index.spread`: no Python step per worker); a worker
    the index has not synced holds nothing."""
    walks: dict[tuple[int, bytes], list[tuple[int, int]]] = {}
    out = []
    for cols in colsets:
        cached = np.zeros(len(cols.ids))
        for bs, extra, positions in cols.groups:
            pairs = walks.get((bs, extra))
            if pairs is None:
                pairs = walks[(bs, extra)] = index.walk(ids, bs, extra)
            spread(pairs, positions, cached, bs)
        out.append(cached)
    return out


def cached_tokens(index: KVIndex, ids: Sequence[int],
                  decoders: Sequence[WorkerInfo]) -> list[int]:
    """How many leading tokens of `ids` each decode worker holds."""
    return [int(c) for c in _cached(index, ids, _build(decoders, index))[0]]


def best_of(cols: _Columns, cached: Floats, placed: Mapping[str, int], prompt_len: int,
            policy: RouterPolicy, tiebreak: int = 0,
            finished: Mapping[str, float] = _NONE) -> int:
    """`router.policy.best_decode` over the columns (the same floats in the same order, the
    same first-from-`tiebreak` choice among equal scores), with the streams `_streams`
    counts running. In C where router/_score.c was built (the same floats, operation for
    operation)."""
    weight = policy.affinity_weight / max(prompt_len, 1)
    if _native_best is not None and _c_counts(placed, finished):
        return _native_best(cols.running, cols.waiting, cols.memory, cached, cols.ids,
                            placed, weight, tiebreak, finished)
    return _best_of_numpy(cols, cached, placed, weight, tiebreak, finished)


_DICTS = (dict, collections.Counter)  # what router/_score.c takes for a per-worker count


def _c_counts(*counts: Mapping[str, float]) -> bool:
    """router/_score.c can take these per-worker counts: plain dicts or Counters, which it
    reads with the dict API (another Mapping, or a dict subclass that computes its items,
    goes the numpy way)."""
    return all(type(c) in _DICTS for c in counts)


def _best_of_numpy(cols: _Columns, cached: Floats, placed: Mapping[str, int], weight: float,
                   tiebreak: int, finished: Mapping[str, float] = _NONE) -> int:
    n = len(cols.ids)
    load = _streams(cols, placed, finished) + cols.waiting
    max_load = float(load.max()) or 1.0
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


@dataclass(frozen=True)
class CostChoice:
    """`best_by_cost`'s answer: positions in the candidate lists, and what was predicted."""

    decode: int
    prefill: int | None  # the best prefill worker for `decode` (None: no prefill worker)
    route: Route
    reason: str
    ttft_s: float
    cost: float
    uncached_tokens: int  # prompt tokens prefilled where it is prefilled


def _streams(cols: _Columns, placed: Mapping[str, int],
             finished: Mapping[str, float] = _NONE) -> Floats:
    """Each decode worker's streams: its heartbeat's running count less what this router
    saw leave it since that count was taken (`finished`: PlacementLedger.finished; no lower
    than 0), or what this router placed there and has not seen finish, whichever is more."""
    running = cols.running
    if finished:
        running = np.maximum(0.0, running - np.fromiter(
            map(finished.get, cols.ids, repeat(0)), dtype=np.float64, count=len(cols.ids)))
    if not placed:
        return running
    return np.maximum(running, np.fromiter(
        map(placed.get, cols.ids, repeat(0)), dtype=np.float64, count=len(cols.ids)))


def _inflight(cols: _Columns, inflight_tokens: Mapping[str, float]) -> Floats:
    return np.fromiter(map(inflight_tokens.get, cols.ids, repeat(0.0)), dtype=np.float64,
                       count=len(cols.ids))


def _first_from(mask: npt.NDArray[np.bool_], tiebreak: int) -> int:
    """The first True position at or after `tiebreak` (mod n), wrapping around."""
    ties = np.flatnonzero(mask)
    k = int(np.searchsorted(ties, tiebreak % len(mask)))
    return int(ties[k if k < len(ties) else 0])


def best_by_cost(prompt_len: int, dcols: _Columns, dcached: Floats, pcols: _Columns,
                 pcached: Floats, placed: Mapping[str, int],
                 inflight_tokens: Mapping[str, float], target_s: float, model: CostModel,
                 tiebreak: int = 0, shares: Floats | None = None, ttft_weight: float = 1.0,
                 beside: _Beside | None = None,
                 finished: Mapping[str, float] = _NONE) -> CostChoice:
    """router.cost's formulas (`local_estimate`, `remote_estimate`, `decide_by_cost`'s rule) over
    every candidate at once: local on each decode worker, remote on each (prefill, decode)
    pair: the least cost, a predicted TTFT past `target_s` priced at `model.late_weight` per
    second; a local prefill longer than `max_local_prefill_s` only where no remote candidate
    meets `target_s`. Equal values take turns like `best_of`: the first decode worker at or
    after `tiebreak` (local before remote on one worker), and the first prefill worker from
    the same place. `shares`: per [prefill, decode] pair, how much the prefill worker's
    compute stalls the decode worker's streams (`DecodeTable.shares`; 0: they compute
    apart); `ttft_weight`: the class's price of a second of TTFT (`Estimate.cost`);
    `beside`: which decode workers compete for each prefill worker's CPUs
    (`DecodeTable.beside`): a prefill worker whose every CPU a busy one wants computes at
    its share of a CPU (router.cost.cpu_factor); `finished`: as `_streams` counts a decode
    worker's streams.
    In C where router/_score.c was built (the same floats, operation for operation)."""
    length = float(prompt_len)
    dp, pp = _prices(dcols, pcols, model)
    if beside is not None:
        pending = dcols.prompt_waiting if not inflight_tokens else np.maximum(
            dcols.prompt_waiting, _inflight(dcols, inflight_tokens))
        long_prompt = prompt_len >= LONG_STEP_TOKENS
        busy = (_streams(dcols, placed, finished) > 0) | (pending > 0)
        factors = cpu_factors(beside, pcols, busy, long_prompt)
        idle = cpu_factors(beside, pcols, np.zeros_like(busy), long_prompt) \
            if busy.any() else factors
        if (factors < idle).any():
            # For the seconds the busy workers are expected to stay so (`contended_factor`).
            queued = pp.queued if not inflight_tokens else np.maximum(
                pp.queued, _inflight(pcols, inflight_tokens))
            work = (queued + np.maximum(0.0, length - pcached)) / pp.rate
            horizon = model.contention_horizon_s
            with np.errstate(divide="ignore", invalid="ignore"):
                factors = np.where((factors >= idle) | (work <= factors * horizon), factors,
                                   work / (horizon + (work - factors * horizon) / idle))
        if (factors != 1.0).any():
            pp = _Priced(rate=pp.rate * factors, step=pp.step, transfer=pp.transfer,
                         queued=pp.queued)
    if _native_cost is not None and _c_counts(placed, inflight_tokens, finished):
        w, p, local, ttft, cost = _native_cost(
            length, dcached, dcols.running, dcols.prompt_waiting, dp.rate, dp.step, dcols.ids,
            pcached, pp.queued, pp.rate, pp.transfer, pcols.ids, placed, inflight_tokens,
            shares, float(model.absorbed_tokens), model.decode_row_fraction,
            model.stall_weight, model.tpot_weight, model.late_weight, model.remote_overhead_s,
            model.max_local_prefill_s, target_s, ttft_weight, tiebreak, finished)
        route = Route.LOCAL if local else Route.REMOTE
        prefilled = dcached[w] if local else pcached[p]
        return CostChoice(w, p if p >= 0 else None, route, _cost_reason(route, p >= 0,
                                                                         ttft > target_s),
                          ttft, cost, int(max(0.0, length - prefilled)))
    return _best_by_cost_numpy(length, dcols, dcached, dp, pcols, pcached, pp, placed,
                               inflight_tokens, target_s, model, tiebreak, shares, ttft_weight,
                               finished)


def _cost_reason(route: Route, any_prefill: bool, over: bool) -> str:
    if not any_prefill:
        return "no_prefill_worker"
    return "cost_over_target" if over else f"cost_{route.value}"


# (local, any prefill worker, over the target) -> the route and `_cost_reason`: looked up,
# not formatted, on the router's hot path.
_FAST_ROUTES = {(local, any_prefill, over): (route, _cost_reason(route, any_prefill, over))
                for local, route in ((True, Route.LOCAL), (False, Route.REMOTE))
                for any_prefill in (True, False) for over in (True, False)}


def _best_by_cost_numpy(length: float, dcols: _Columns, dcached: Floats, dp: _Priced,
                        pcols: _Columns, pcached: Floats, pp: _Priced,
                        placed: Mapping[str, int], inflight_tokens: Mapping[str, float],
                        target_s: float, model: CostModel, tiebreak: int,
                        shares: Floats | None, ttft_weight: float,
                        finished: Mapping[str, float] = _NONE) -> CostChoice:
    n, m = len(dcols.ids), len(pcols.ids)
    # Decode side, per w.
    unc = np.maximum(0.0, length - dcached)
    streams = _streams(dcols, placed, finished)
    rate, step = dp.rate, dp.step
    pending = dcols.prompt_waiting if not inflight_tokens else np.maximum(
        dcols.prompt_waiting, _inflight(dcols, inflight_tokens))
    ttft_local = (pending + unc) / rate + step
    stall = np.maximum(0.0, unc - model.absorbed_tokens) / rate * streams
    compute_local = unc / rate
    tpot = step * (1.0 + model.decode_row_fraction
                   * np.maximum(0.0, streams + 1.0 - dcols.running))
    cost_local = ttft_weight * ttft_local + model.stall_weight * stall + model.tpot_weight * tpot
    # Remote: a (prefill, decode) matrix; each w's best p by cost less w's TPOT term (the
    # same for every p): by TTFT where no pair shares CPUs; equal ones from `tiebreak` on.
    if m:
        lack = np.maximum(0.0, length - pcached)
        ppending = pp.queued if not inflight_tokens else np.maximum(
            pp.queued, _inflight(pcols, inflight_tokens))
        ttft_pw = ((((ppending + lack) / pp.rate)[:, None] + unc[None, :] * pp.transfer[:, None])
                   + model.remote_overhead_s) + step[None, :]
        order = np.arange(tiebreak, tiebreak + m) % m  # argmin takes the first minimum
        cols_n = np.arange(n)
        if shares is None:
            best_p = order[np.argmin(ttft_pw[order], axis=0)]
            stall_remote = np.zeros(n)
        else:
            # Where p computes on w's CPUs it waits for w's queued prompt work, and w's
            # streams stall as if w computed p's tokens, by p's share of the CPUs.
            ttft_pw = np.where(shares > 0, ttft_pw + (pending / rate)[None, :], ttft_pw)
            stall_pw = shares * ((np.maximum(0.0, lack - model.absorbed_tokens)[:, None]
                                  / rate[None, :]) * streams[None, :])
            key = (ttft_weight * (ttft_pw + model.late_weight
                                  * np.maximum(0.0, ttft_pw - target_s))
                   + model.stall_weight * stall_pw)
            best_p = order[np.argmin(key[order], axis=0)]
            stall_remote = stall_pw[best_p, cols_n]
        ttft_remote = ttft_pw[best_p, cols_n]
        cost_remote = ttft_weight * (ttft_remote + model.late_weight
                                     * np.maximum(0.0, ttft_remote - target_s))
        cost_remote = cost_remote + model.tpot_weight * tpot
        if shares is not None:
            cost_remote = cost_remote + model.stall_weight * stall_remote
        # A long local prefill only where no remote candidate meets the target.
        allowed_local = ~((ttft_remote <= target_s)
                          & (compute_local > model.max_local_prefill_s))
    else:
        allowed_local = np.ones(n, dtype=bool)
        ttft_remote = cost_remote = np.full(n, np.inf)
    cost_local = cost_local + ttft_weight * model.late_weight * np.maximum(
        0.0, ttft_local - target_s)
    local_v = np.where(allowed_local, cost_local, np.inf)
    best = min(float(local_v.min()), float(cost_remote.min()))
    w = _first_from((local_v == best) | (cost_remote == best), tiebreak)
    route = Route.LOCAL if local_v[w] == best else Route.REMOTE
    over = (ttft_local if route is Route.LOCAL else ttft_remote)[w] > target_s
    p = int(best_p[w]) if m else None
    reason = _cost_reason(route, bool(m), bool(over))
    if route is Route.LOCAL:
        return CostChoice(w, p, route, reason, float(ttft_local[w]), float(cost_local[w]),
                          int(unc[w]))
    assert p is not None
    return CostChoice(w, p, route, reason, float(ttft_remote[w]), float(cost_remote[w]),
                      int(max(0.0, length - pcached[p])))


def place(ids: Sequence[int], latency: LatencyClass, decoders: Sequence[WorkerInfo],
          prefills: Sequence[WorkerInfo], index: KVIndex, placed: Mapping[str, int],
          policy: RouterPolicy, *, cost: CostModel | None = None, target_s: float = 30.0,
          inflight_tokens: Mapping[str, float] = _NONE, tiebreak: int = 0,
          table: DecodeTable | None = None, listing: object = None,
          finished: Mapping[str, float] = _NONE) -> Placement:
    """`decoders` must not be empty. `placed`: requests this router placed per decode worker
    and not finished; heartbeats lag a burst by up to a second, so those count as running
    too, or a burst would all go to the worker that looked idlest at the last heartbeat.
    With `policy.placement == "cost"`, the decode worker, local vs remote and the prefill
    worker all follow router.cost against `target_s` (the latency class's TTFT target;
    `best_by_cost`); `inflight_tokens`: prompt tokens this router sent each worker to
    prefill that are not done yet; `tiebreak`: where equal scores start (the router advances
    it per request); `table`: the caller's DecodeTable, kept across calls (without one, the
    columns are built for this call, and cost placement's table in C is not); `listing`:
    the caller's name for this `decoders` and `prefills` (equal names only for the very
    same lists of the same records, e.g. the router's directory generation; None: the table
    compares the workers themselves); `finished`: this router's requests that left each
    decode worker since its heartbeat's running count was taken (PlacementLedger.finished:
    a worker counts max(that count less these, placed) streams, so a worker whose requests
    just ended does not look busy, and the next arrivals herd elsewhere, until its next
    heartbeat). The decision's `uncached_tokens` are the prompt tokens the worker that
    prefills must compute (what the router's ledger charges it)."""
    kept = table is not None  # kept across calls: worth cost placement's table in C
    table = table or DecodeTable()
    cols = table.columns(decoders, index, listing)
    if policy.placement == "cost":
        pcols = table.prefill_columns(prefills, index, listing)
        model = cost or _DEFAULT_COST
        fast = table.fast_cost(cols, pcols, model) if kept else None
        if fast is not None and _c_counts(placed, inflight_tokens, finished):
            geometry = fast.geometry
            pairs = [] if geometry is None else index.walk(ids, geometry[0], geometry[1])
            w, p, local, ttft, _, held, uncached = fast.table.choose(
                pairs, 0.0 if geometry is None else float(geometry[0]), float(len(ids)),
                placed, inflight_tokens, target_s, policy.ttft_weights[latency], tiebreak,
                finished)
            route, reason = _FAST_ROUTES[local, p >= 0, ttft > target_s]
            return Placement(decoders[w], None if p < 0 else prefills[p],
                             Decision(route, reason, uncached, ttft), held)
        cached, pcached = _cached(index, ids, cols, pcols)
        c = best_by_cost(len(ids), cols, cached, pcols, pcached, placed, inflight_tokens,
                         target_s, model, tiebreak, table.shares(cols, pcols),
                         policy.ttft_weights[latency], table.beside(cols, pcols), finished)
        return Placement(decoders[c.decode], None if c.prefill is None else prefills[c.prefill],
                         Decision(c.route, c.reason, c.uncached_tokens, c.ttft_s),
                         int(cached[c.decode]))
    (cached,) = _cached(index, ids, cols)
    i = best_of(cols, cached, placed, len(ids), policy, tiebreak, finished)
    decode, best_cached = decoders[i], int(cached[i])
    prefill = least_backlog(prefills, inflight_tokens, tiebreak)
    backlog = None if prefill is None else prefill.load.queued_tokens
    decision = decide_route(len(ids), best_cached, latency, backlog, policy)
    return Placement(decode, prefill, decision, best_cached)
