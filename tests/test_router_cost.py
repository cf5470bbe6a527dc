"""Local vs remote prefill by predicted cost (router.cost), and placement with it."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.control.load import WorkerLoad
from pdserve.control.workers import WorkerInfo, WorkerInfoError
from pdserve.engine.block_manager import block_hashes
from pdserve.kv_events import KVEventBatch, KVOp
from pdserve.types import LatencyClass
from router import placement
from router.cost import (
    CostModel,
    Estimate,
    contended_factor,
    cpu_factor,
    decide_by_cost,
    local_estimate,
    peer_prefill_rate,
    remote_estimate,
)
from router.kv_index import KVIndex
from router.ledger import PlacementLedger
from router.placement import DecodeTable, best_by_cost, place
from router.policy import Route, RouterPolicy

MODEL = CostModel()
DECODE = WorkerLoad(running=8, prefill_tokens_per_s=1000.0, decode_step_s=0.03)
PREFILL = WorkerLoad(prefill_tokens_per_s=1500.0, kv_transfer_s_per_token=1e-5)


def _route(decode: WorkerLoad, prefill: WorkerLoad | None, uncached: int,
           target_s: float = 30.0, **inflight: float) -> Route:
    local = local_estimate(decode, uncached, MODEL, inflight_tokens=inflight.get("local", 0))
    remote = None if prefill is None else remote_estimate(
        prefill, decode, uncached, MODEL, inflight_tokens=inflight.get("remote", 0))
    return decide_by_cost(local, remote, uncached, target_s, MODEL)[0].route


def test_long_prompts_leave_a_busy_decode_worker_short_ones_stay() -> None:
    assert _route(DECODE, PREFILL, 2000) is Route.REMOTE  # 8 streams would stall 2 s each
    assert _route(DECODE, PREFILL, 8) is Route.LOCAL  # the hand-off costs more than 8 tokens
    assert _route(DECODE, None, 2000) is Route.LOCAL


def test_an_idle_decode_worker_prefills_itself_when_the_pool_is_backed_up() -> None:
    idle = WorkerLoad(running=0, prefill_tokens_per_s=1000.0, decode_step_s=0.02)
    backed_up = WorkerLoad(queued_tokens=30000, prefill_tokens_per_s=1500.0)
    assert _route(idle, backed_up, 2000, target_s=10.0) is Route.LOCAL  # remote: ~21 s
    assert _route(idle, PREFILL, 2000) is Route.REMOTE  # faster pool, nothing queued there


def test_in_flight_tokens_count_before_the_next_heartbeat() -> None:
    idle = WorkerLoad(running=0, prefill_tokens_per_s=1000.0)
    assert _route(idle, PREFILL, 2000) is Route.REMOTE
    # A burst went there: remote would take ~28 s.
    assert _route(idle, PREFILL, 2000, target_s=10.0, remote=40000) is Route.LOCAL


def test_time_past_the_target_is_priced() -> None:
    # Remote is cheaper overall (no stall on the 8 running streams) and stays so a little
    # past a tight target; a queue far past it loses to the local prefill that meets it.
    slow_pool = WorkerLoad(queued_tokens=3000, prefill_tokens_per_s=1500.0)
    assert _route(DECODE, slow_pool, 1000, target_s=30.0) is Route.REMOTE
    assert _route(DECODE, slow_pool, 1000, target_s=1.5) is Route.REMOTE  # 1.2 s late: +4.9
    backed_up = WorkerLoad(queued_tokens=9000, prefill_tokens_per_s=1500.0)
    assert _route(DECODE, backed_up, 1000, target_s=30.0) is Route.REMOTE
    assert _route(DECODE, backed_up, 1000, target_s=1.5) is Route.LOCAL  # 5.2 s late: +21
    local = local_estimate(DECODE, 1000, MODEL)
    assert local.cost(MODEL, 0.5) == pytest.approx(
        local.cost(MODEL) + MODEL.late_weight * (local.ttft_s - 0.5))
    assert local.cost(MODEL, 30.0) == local.cost(MODEL)


def test_priors_stand_in_until_workers_measure() -> None:
    unmeasured = WorkerLoad()
    est = local_estimate(unmeasured, 500, MODEL)
    assert est.ttft_s == 500 / MODEL.prior_prefill_tokens_per_s + MODEL.prior_decode_step_s


def _worker(worker_id: str, role: str, load: WorkerLoad,
            where: tuple[str, tuple[int, ...]] = ("", ()), nice: int = 0, threads: int = 0,
            adapt: bool = False) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, grpc_address="127.0.0.1:1",  # type: ignore[arg-type]
                      model_id="m", epoch=1, started_at=time.time(), load=load,
                      host_id=where[0], cpus=where[1], nice=nice, threads=threads,
                      adapt_threads=adapt)


def test_placement_with_the_cost_policy() -> None:
    decoders = [_worker("d0", "decode", DECODE)]
    prefills = [_worker("p0", "prefill", WorkerLoad(queued_tokens=50000,
                                                    prefill_tokens_per_s=1500.0)),
                _worker("p1", "prefill", PREFILL)]
    policy = RouterPolicy(placement="cost")
    p = place(list(range(2000)), LatencyClass.STANDARD, decoders, prefills, KVIndex(), {},
              policy)
    assert p.decision.route is Route.REMOTE and p.prefill is not None
    assert p.prefill.worker_id == "p1" and p.decision.reason == "cost_remote"
    assert p.decision.uncached_tokens == 2000
    short = place(list(range(10)), LatencyClass.STANDARD, decoders, prefills, KVIndex(), {},
                  policy)
    assert short.decision.route is Route.LOCAL


def test_a_long_local_prefill_is_taken_only_when_remote_misses_the_target() -> None:
    idle = WorkerLoad(running=0, prefill_tokens_per_s=1000.0, decode_step_s=0.02)
    queued_pool = WorkerLoad(queued_tokens=3000, prefill_tokens_per_s=1000.0)
    # Local would be faster (2 s vs 5 s) and stalls nobody now, but blocks the next arrivals.
    assert _route(idle, queued_pool, 2000, target_s=30.0) is Route.REMOTE
    assert _route(idle, queued_pool, 2000, target_s=3.0) is Route.LOCAL


# ---------------------------------------------------------------------- choice by cost


def _index(holds: dict[str, int], ids: list[int], bs: int = 16) -> KVIndex:
    """An index where each worker holds the prompt's first `holds[w]` blocks."""
    hashes = block_hashes(ids, bs, b"m")
    idx = KVIndex()
    for w, k in holds.items():
        idx.apply(w, KVEventBatch(1, 1, bs, tuple((KVOp.STORED, x) for x in hashes[:k]),
                                  snapshot=True))
    return idx


loads = st.builds(
    WorkerLoad, running=st.integers(0, 12), queued_tokens=st.sampled_from([0, 0, 500, 4000]),
    prefill_tokens_per_s=st.sampled_from([0.0, 300.0, 1000.0, 1500.0]),
    decode_step_s=st.sampled_from([0.0, 0.03, 0.1]),
    waiting_prompt_tokens=st.sampled_from([None, 0.0, 700.0]),
    kv_transfer_s_per_token=st.sampled_from([None, 0.0, 1e-5, 1e-3]),
    prefill_cpu_share=st.sampled_from([None, 0.0, 0.25, 1.0]))


# Where a worker computes: unknown, or a host with a CPU set (("h1", ()): every CPU of h1).
wheres = st.sampled_from([("", ()), ("h1", ()), ("h1", (0,)), ("h1", (1,)), ("h1", (0, 1)),
                          ("h1", (0, 1, 2)), ("h2", (0,))])


@settings(max_examples=400, deadline=None)
@given(dloads=st.lists(loads, min_size=1, max_size=6), ploads=st.lists(loads, max_size=4),
       dwhere=st.lists(wheres, min_size=6, max_size=6),
       pwhere=st.lists(wheres, min_size=4, max_size=4),
       pnice=st.lists(st.sampled_from([0, 5, 19, -3]), min_size=4, max_size=4),
       pthreads=st.lists(st.sampled_from([0, 1, 2, 3]), min_size=4, max_size=4),
       padapt=st.lists(st.booleans(), min_size=4, max_size=4),
       dheld=st.lists(st.integers(0, 8), min_size=6, max_size=6),
       pheld=st.lists(st.integers(0, 8), min_size=4, max_size=4),
       placed=st.lists(st.integers(0, 4), min_size=6, max_size=6),
       inflight=st.lists(st.sampled_from([0, 0, 300, 3000]), min_size=10, max_size=10),
       length=st.integers(1, 140) | st.sampled_from([255, 256, 300]),
       target=st.sampled_from([0.3, 2.0, 30.0]),
       tiebreak=st.integers(0, 50),
       remote_overhead=st.sampled_from([0.02, 0.08, 0.0]),
       weight=st.sampled_from([1.0, 0.25, 3.0]))
def test_cost_placement_takes_the_cheapest_candidate(
        dloads: list[WorkerLoad], ploads: list[WorkerLoad],
        dwhere: list[tuple[str, tuple[int, ...]]], pwhere: list[tuple[str, tuple[int, ...]]],
        pnice: list[int], pthreads: list[int], padapt: list[bool], dheld: list[int],
        pheld: list[int], placed: list[int], inflight: list[int], length: int, target: float,
        tiebreak: int, remote_overhead: float, weight: float) -> None:
    """Over every candidate (local on each decode worker, remote on each (prefill, decode)
    pair), priced by the scalar reference (`local_estimate`, `remote_estimate`, with the
    tokens each worker lacks from the index and the router's in-flight accounting), place()
    takes one of least cost, time past the target priced, and reports its prediction's
    numbers. A prefill worker that shares a decode worker's CPUs stalls its streams, by its
    share of them at its priority, and where busy workers want every CPU it has, computes
    at its share of one (`cpu_factor`); one that adapts its threads computes a short
    prompt on one thread. The remote fixed cost may carry the router's learned correction
    (router.calibration); the class's TTFT weight scales its TTFT and lateness."""
    model = dataclasses.replace(MODEL, remote_overhead_s=remote_overhead)
    ids = list(range(1000, 1000 + length))
    decoders = [_worker(f"d{i}", "decode", w, dwhere[i]) for i, w in enumerate(dloads)]
    prefills = [_worker(f"p{i}", "prefill", w, pwhere[i], pnice[i], pthreads[i], padapt[i])
                for i, w in enumerate(ploads)]
    index = _index({**{f"d{i}": dheld[i] for i in range(len(dloads))},
                    **{f"p{i}": pheld[i] for i in range(len(ploads))}}, ids)
    placed_by = {f"d{i}": placed[i] for i in range(len(dloads)) if placed[i]}
    infl = {w.worker_id: float(inflight[i]) for i, w in enumerate([*decoders, *prefills])}
    held = index.match_prompt(ids, 16, b"m")
    peer = peer_prefill_rate(w.load for w in [*decoders, *prefills])

    def lacks(w: WorkerInfo) -> int:
        return max(0, length - 16 * held.get(w.worker_id, 0))

    def busy(d: WorkerInfo) -> bool:
        return (max(d.load.running, placed_by.get(d.worker_id, 0)) > 0
                or max(d.load.waiting_prompt_tokens or 0.0, infl[d.worker_id]) > 0)

    def factor(q: WorkerInfo, idle: bool = False) -> float:
        beside = [d for d in decoders if q.shares_cpus(d) and busy(d) and not idle]
        return cpu_factor(q.load.prefill_cpu_share, len(q.cpus),
                          [q.cpu_share_beside(d) for d in beside],
                          sum(q.cpus_shared(d) for d in beside), threads=q.threads,
                          adapt=q.adapt_threads, long_prompt=length >= 256)

    cands: list[tuple[Estimate, str, str | None, int]] = []
    for d in decoders:
        n = max(d.load.running, placed_by.get(d.worker_id, 0))
        local = local_estimate(d.load, lacks(d), model, inflight_tokens=infl[d.worker_id],
                               streams=n, peer_rate=peer)
        remotes = [remote_estimate(q.load, d.load, lacks(d), model,
                                   inflight_tokens=infl[q.worker_id],
                                   prefill_uncached=lacks(q), streams=n, peer_rate=peer,
                                   shares_cpus=q.stall_share(d),
                                   decode_inflight_tokens=infl[d.worker_id],
                                   rate_factor=factor(q), idle_factor=factor(q, True))
                   for q in prefills]
        best_remote = min(remotes, key=lambda e: e.cost(model, target, weight)) \
            if remotes else None
        allowed = not (best_remote is not None and best_remote.ttft_s <= target
                       and local.compute_s > model.max_local_prefill_s)
        if allowed:
            cands.append((local, d.worker_id, None, lacks(d)))
        for q, e in zip(prefills, remotes, strict=True):
            cands.append((e, d.worker_id, None, lacks(q)))

    def objective(c: tuple[Estimate, str, str | None, int]) -> float:
        return c[0].cost(model, target, weight)

    best = min(map(objective, cands))

    p = place(ids, LatencyClass.STANDARD, decoders, prefills, index, placed_by,
              RouterPolicy(placement="cost", ttft_weights={LatencyClass.STANDARD: weight}),
              cost=model, target_s=target,
              inflight_tokens=infl, tiebreak=tiebreak)
    d = p.decode
    assert p.cached_tokens == length - lacks(d)
    n = max(d.load.running, placed_by.get(d.worker_id, 0))
    if p.decision.route is Route.LOCAL:
        got = local_estimate(d.load, lacks(d), model, inflight_tokens=infl[d.worker_id],
                             streams=n, peer_rate=peer)
        assert p.decision.uncached_tokens == lacks(d)
    else:
        assert p.prefill is not None
        got = remote_estimate(p.prefill.load, d.load, lacks(d), model,
                              inflight_tokens=infl[p.prefill.worker_id],
                              prefill_uncached=lacks(p.prefill), streams=n,
                              peer_rate=peer, shares_cpus=p.prefill.stall_share(d),
                              decode_inflight_tokens=infl[d.worker_id],
                              rate_factor=factor(p.prefill),
                              idle_factor=factor(p.prefill, True))
        assert p.decision.uncached_tokens == lacks(p.prefill)
    assert (p.decision.reason == "cost_over_target") == (got.ttft_s > target) or not prefills
    assert objective((got, "", None, 0)) == pytest.approx(best, rel=1e-9, abs=1e-12)
    if not prefills:
        assert p.decision.route is Route.LOCAL and p.decision.reason == "no_prefill_worker"


def test_the_c_cost_choice_equals_the_numpy_one_exactly() -> None:
    """router/_score.c's best_cost (the router's hot path) against best_by_cost's numpy:
    the same positions, route, reason and floats to the last bit, on random columns with
    many equal costs (ties take turns from `tiebreak` alike), CPU shares or none, the
    router's placed and in-flight counts, and without prefill workers."""
    pytest.importorskip("router._score")
    rng = np.random.default_rng(18)
    for case in range(3000):
        n, m = int(rng.integers(1, 9)), int(rng.integers(0, 5))
        decoders = [_worker(f"d{i}", "decode", _random_load(rng), ("", ())) for i in range(n)]
        prefills = [_worker(f"p{i}", "prefill", _random_load(rng), ("", ())) for i in range(m)]
        table, index = DecodeTable(), KVIndex()
        dcols, pcols = table.columns(decoders, index), table.prefill_columns(prefills, index)
        length = int(rng.choice([1, 16, 64, 300, 2000]))
        dcached = rng.choice([0, 16, 64, 320], size=n).astype(float)
        pcached = rng.choice([0, 16, 320], size=m).astype(float)
        placed = {f"d{i}": int(rng.integers(1, 5)) for i in range(n) if rng.random() < 0.4}
        inflight = collections.Counter({w: int(rng.choice([100, 3000]))
                                        for w in [*dcols.ids, *pcols.ids] if rng.random() < 0.3})
        finished = {f"d{i}": int(rng.integers(1, 4)) for i in range(n) if rng.random() < 0.3}
        shares = None if m == 0 or rng.random() < 0.5 else \
            rng.choice([0.0, 0.0, 1.0, 0.512], size=(m, n))
        model = dataclasses.replace(MODEL, remote_overhead_s=float(rng.choice([0.0, 0.02])))
        target, weight = float(rng.choice([0.3, 2.0, 30.0])), float(rng.choice([1.0, 0.1]))
        tiebreak = int(rng.integers(0, 100))
        got = best_by_cost(length, dcols, dcached, pcols, pcached, placed, inflight, target,
                           model, tiebreak, shares, weight, finished=finished)
        peer = min(dcols.min_rate, pcols.min_rate)
        peer_rate = None if peer == np.inf else peer
        want = placement._best_by_cost_numpy(
            float(length), dcols, dcached, dcols.prices(model, peer_rate), pcols, pcached,
            pcols.prices(model, peer_rate), placed, inflight, target, model, tiebreak, shares,
            weight, finished)
        assert got == want, case


def test_the_held_c_cost_table_chooses_as_the_numpy_path_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`place`'s path through router/_score.c's CostTable (the candidates held across
    decisions, the prompt's walk spread in C) against the same placement through the
    columns' numpy arrays: the same workers, route, reason, prediction and token counts on
    random fleets of up to 150 decode workers (index slots past 64: masks wider than a
    machine word) and prefill workers, each holding a random share of the prompt, with the
    router's placed and in-flight counts, several latency classes and `tiebreak`s."""
    pytest.importorskip("router._score")
    rng = np.random.default_rng(78)
    ids = list(range(1600))
    hashes = block_hashes(ids, 16, b"m")
    policy = RouterPolicy(placement="cost")
    took = 0
    for case in range(150):
        n, m = int(rng.choice([1, 3, 70, 150])), int(rng.integers(0, 4))
        decoders = [_worker(f"d{i}", "decode", _random_load(rng)) for i in range(n)]
        prefills = [_worker(f"p{i}", "prefill", _random_load(rng)) for i in range(m)]
        index = KVIndex()
        for w in [*decoders, *prefills]:
            if rng.random() < 0.7:
                k = int(rng.integers(0, len(hashes) + 1))
                index.apply(w.worker_id, KVEventBatch(1, 1, 16, tuple(
                    (KVOp.STORED, x) for x in hashes[:k]), snapshot=True))
        placed = {w.worker_id: int(rng.integers(1, 4)) for w in decoders
                  if rng.random() < float(rng.choice([0.3, 1.0]))}
        inflight = collections.Counter({w.worker_id: float(rng.choice([100, 3000]))
                                        for w in [*decoders, *prefills] if rng.random() < 0.3})
        finished = {w.worker_id: int(rng.integers(1, 4)) for w in decoders
                    if rng.random() < float(rng.choice([0.0, 0.3, 1.0]))}
        for i in range(int(rng.integers(0, 3))):  # workers gone from the lists since
            placed[f"gone{i}"] = inflight[f"gone{i}"] = finished[f"gone{i}"] = 2
        model = dataclasses.replace(MODEL, remote_overhead_s=float(rng.choice([0.0, 0.02])))
        prompt = ids[:int(rng.choice([10, 300, 1600]))]
        for k in range(4):
            latency = list(LatencyClass)[k % len(LatencyClass)]
            target, tiebreak = float(rng.choice([0.3, 2.0, 30.0])), int(rng.integers(0, 500))
            table = DecodeTable()
            got = place(prompt, latency, decoders, prefills, index, placed, policy, cost=model,
                        target_s=target, inflight_tokens=inflight, tiebreak=tiebreak,
                        table=table, finished=finished)
            took += table.fast_cost(table.columns(decoders, index),
                                    table.prefill_columns(prefills, index), model) is not None
            with monkeypatch.context() as mp:
                mp.setattr(placement, "_NativeTable", None)
                want = place(prompt, latency, decoders, prefills, index, placed, policy,
                             cost=model, target_s=target, inflight_tokens=inflight,
                             tiebreak=tiebreak, finished=finished)
            assert got == want, (case, k)
    assert took == 600  # every case took the held table's path


def test_the_held_cost_table_is_kept_and_left_where_it_does_not_apply() -> None:
    """The table is built once per candidate lists and cost model; where a prefill worker
    shares a decode worker's CPUs (its compute priced per decision) placement goes through
    the columns, and still chooses."""
    pytest.importorskip("router._score")
    decoders = [_worker("d0", "decode", DECODE, ("h1", (0,))),
                _worker("d1", "decode", DECODE, ("h1", (1,)))]
    apart = [_worker("p0", "prefill", PREFILL, ("h2", (0,)))]
    beside = [_worker("p0", "prefill", PREFILL, ("h1", (0, 1)))]
    table, index = DecodeTable(), KVIndex()
    dcols = table.columns(decoders, index)
    fast = table.fast_cost(dcols, table.prefill_columns(apart, index), MODEL)
    assert fast is not None
    assert table.fast_cost(dcols, table.prefill_columns(apart, index), MODEL) is fast
    assert table.fast_cost(dcols, table.prefill_columns(apart, index),
                           dataclasses.replace(MODEL)) is not fast
    assert table.fast_cost(dcols, table.prefill_columns(beside, index), MODEL) is None
    p = place(list(range(2000)), LatencyClass.STANDARD, decoders, beside, index, {},
              RouterPolicy(placement="cost"), table=table)
    assert p.decode.worker_id in ("d0", "d1")


def test_the_held_cost_table_checks_its_input() -> None:
    """Wrong buffers and positions past a list are refused when the table is built, not
    read past their end when it chooses."""
    from router._score import CostTable, best_cost
    one, two = np.ones(1), np.ones(2)
    none = np.zeros(0, dtype=np.intp)

    def table(dpos: np.ndarray = none, ppos: np.ndarray = none, queued: object = two
              ) -> CostTable:
        return CostTable(one, one, one, one, ("d",), dpos, queued, two, two, ("p", "q"), ppos,
                         *[1.0] * 7)

    assert table().choose([], 16.0, 32.0, {}, {}, 30.0, 1.0, 0)[:2] == (0, 0)
    got = table(np.array([-1, 0], dtype=np.intp)).choose([(2, 0b11)], 16.0, 48.0, {}, {},
                                                          30.0, 1.0, 0)
    assert got[5:] in ((32, 16), (32, 48))  # slot 1 is d0: 32 tokens cached there
    far = np.full(71, -1, dtype=np.intp)
    for bit in (63, 70):  # a 64th slot (the highest of a machine word), a 71st (past it)
        far[bit] = 0
        got = table(far).choose([(3, 1 << bit), (5, 1 << 2)], 16.0, 96.0, {}, {}, 30.0, 1.0, 0)
        far[bit] = -1
        assert got[5] == 48
    # A list naming a worker twice (never the router's): each position counts its streams.
    twice = CostTable(two, two, two, two, ("d", "d"), none, two, two, two, ("p", "q"), none,
                      *[1.0] * 7)
    got = twice.choose([], 16.0, 2000.0, {"d": 9, "p": 1}, {"q": 7.0}, 30.0, 1.0, 1)
    assert got[:5] == best_cost(2000.0, np.zeros(2), two, two, two, two, ("d", "d"),
                                np.zeros(2), two, two, two, ("p", "q"), {"d": 9, "p": 1},
                                {"q": 7.0}, None, *[1.0] * 7, 30.0, 1.0, 1)
    with pytest.raises(ValueError, match="queued"):
        table(queued=one)
    with pytest.raises(ValueError, match="dpositions"):
        table(np.array([1], dtype=np.intp))
    with pytest.raises(TypeError, match="intp"):
        table(np.array([0], dtype=np.int32))
    with pytest.raises(TypeError, match="intp"):
        table(np.array([0.0]))
    with pytest.raises(ValueError, match="non-negative"):
        table().choose([(1, -1)], 16.0, 32.0, {}, {}, 30.0, 1.0, 0)
    with pytest.raises(TypeError, match="pairs"):
        table().choose([(1,)], 16.0, 32.0, {}, {}, 30.0, 1.0, 0)


def _random_load(rng: np.random.Generator) -> WorkerLoad:
    return WorkerLoad(running=int(rng.integers(0, 4)), queued_tokens=int(rng.choice([0, 500])),
                      prefill_tokens_per_s=float(rng.choice([0.0, 300.0, 1000.0])),
                      decode_step_s=float(rng.choice([0.0, 0.03])),
                      waiting_prompt_tokens=float(rng.choice([0.0, 700.0])),
                      kv_transfer_s_per_token=float(rng.choice([0.0, 1e-3])))


def test_the_c_cost_choice_checks_its_input() -> None:
    """Wrong buffers are refused, not read past their end."""
    from router._score import best_cost
    one, two = np.ones(1), np.ones(2)

    def call(pcached: np.ndarray, shares: object = None) -> object:
        return best_cost(1.0, one, one, one, one, one, ("d",), pcached, two, two, two,
                         ("p", "q"), {}, {}, shares, *[1.0] * 9, 0)

    assert call(two)[:2] == (0, 0)  # one decode worker; equal prefill workers: the first
    with pytest.raises(ValueError, match="pcached"):
        call(one)
    with pytest.raises(ValueError, match="shares"):
        call(two, np.ones(3))
    with pytest.raises(TypeError, match="float64"):
        call(two, np.ones(2, dtype=np.float32))


def test_the_prefill_worker_is_priced_by_what_its_own_cache_lacks() -> None:
    """Two equal prefill workers; the one holding the prompt's history computes 32 tokens
    instead of 2,000, and gets the request, charged only those."""
    ids = list(range(2000))
    decoders = [_worker("d0", "decode", DECODE)]
    prefills = [_worker("p0", "prefill", PREFILL), _worker("p1", "prefill", PREFILL)]
    index = _index({"p1": 123}, ids)
    for tiebreak in range(4):
        p = place(ids, LatencyClass.STANDARD, decoders, prefills, index, {},
                  RouterPolicy(placement="cost"), tiebreak=tiebreak)
        assert p.decision.route is Route.REMOTE and p.prefill is not None
        assert p.prefill.worker_id == "p1" and p.decision.uncached_tokens == 2000 - 123 * 16
    # The transfer is still the decode worker's whole lack.
    near = remote_estimate(PREFILL, DECODE, 2000, MODEL, prefill_uncached=32)
    far = remote_estimate(PREFILL, DECODE, 2000, MODEL)
    assert far.ttft_s - near.ttft_s == pytest.approx((2000 - 32) / 1500.0)


def test_decode_choice_by_cost_keeps_cache_affinity() -> None:
    """Equal decode workers and no prefill pool: the one holding the conversation's history
    has the least to prefill, whatever the tie-break; with a prefill pool that lacks it, too
    (a remote prefill would recompute it)."""
    ids = list(range(1000))
    idle = WorkerLoad(running=2, prefill_tokens_per_s=1000.0, decode_step_s=0.03)
    decoders = [_worker(f"d{i}", "decode", idle) for i in range(4)]
    index = _index({"d2": 60}, ids)
    for prefills in ([], [_worker("p0", "prefill", PREFILL)]):
        for tiebreak in range(4):
            p = place(ids, LatencyClass.INTERACTIVE, decoders, prefills, index, {},
                      RouterPolicy(placement="cost"), tiebreak=tiebreak, target_s=10.0)
            assert p.decode.worker_id == "d2" and p.cached_tokens == 960
            assert p.decision.route is Route.LOCAL and p.decision.uncached_tokens == 40


def test_equal_candidates_take_turns_and_a_burst_does_not_herd() -> None:
    """Idle equal workers: each request goes to the next decode worker from the tie-break
    (the threshold path's rotation), and with the router's ledger charging what it placed, a
    burst of 8 long prompts spreads over all 4 decode and both prefill workers."""
    decoders = [_worker(f"d{i}", "decode", WorkerLoad(prefill_tokens_per_s=1000.0,
                                                      decode_step_s=0.03)) for i in range(4)]
    prefills = [_worker(f"p{i}", "prefill", PREFILL) for i in range(2)]
    policy = RouterPolicy(placement="cost")
    short = list(range(10))
    assert [place(short, LatencyClass.STANDARD, decoders, prefills, KVIndex(), {}, policy,
                  tiebreak=t).decode.worker_id for t in range(6)] == \
        ["d0", "d1", "d2", "d3", "d0", "d1"]
    ledger = PlacementLedger()
    chosen = []
    for i in range(8):
        p = place(list(range(i * 5000, i * 5000 + 3000)), LatencyClass.STANDARD, decoders,
                  prefills, KVIndex(), ledger.placed, policy,
                  inflight_tokens=ledger.inflight_tokens, tiebreak=0)
        ledger.place(f"r{i}", p.decode.worker_id)
        where = p.prefill if p.decision.route is Route.REMOTE else p.decode
        assert where is not None
        ledger.charge(f"r{i}", where.worker_id, p.decision.uncached_tokens)
        chosen.append((p.decode.worker_id, where.worker_id))
    assert sorted(collections.Counter(d for d, _ in chosen).values()) == [2, 2, 2, 2]
    assert {w for _, w in chosen} >= {"p0", "p1"}


def test_a_worker_that_never_prefilled_is_priced_at_its_peers_rate() -> None:
    """A decode worker whose prompts all went remote has measured no prefill rate. Priced at
    the prior (250 tokens/s) it looks too slow to ever prefill locally, so it never measures;
    priced at the slowest rate a peer measured, it takes its share (bench/serve_compare,
    cost placement at c=16, found the first)."""
    never = WorkerLoad(running=6, decode_step_s=0.03)  # no prefill_tokens_per_s
    pool = WorkerLoad(prefill_tokens_per_s=1200.0, queued_tokens=2400, kv_transfer_s_per_token=1e-5)
    assert peer_prefill_rate([never, pool, WorkerLoad(prefill_tokens_per_s=900.0)]) == 900.0
    assert peer_prefill_rate([never, WorkerLoad()]) is None
    assert local_estimate(never, 200, MODEL, peer_rate=1200.0).compute_s == 200 / 1200.0
    decoders = [_worker("d0", "decode", never)]
    prefills = [_worker("p0", "prefill", pool)]
    p = place(list(range(200)), LatencyClass.STANDARD, decoders, prefills, KVIndex(), {},
              RouterPolicy(placement="cost"), target_s=3.0)
    assert p.decision.route is Route.LOCAL  # queue 2 s + stall 6 x 0.11 s vs 1.7 s of stall
    cold = place(list(range(200)), LatencyClass.STANDARD, decoders,
                 [_worker("p0", "prefill", WorkerLoad(kv_transfer_s_per_token=1e-5))],
                 KVIndex(), {}, RouterPolicy(placement="cost"), target_s=3.0)
    assert cold.decision.route is Route.REMOTE  # nobody measured: priors, stall 6 x 0.54 s


def test_a_queue_that_misses_the_class_target_is_avoided() -> None:
    """The prefill worker's queue (a predicted 4.8 s) fits the 30 s standard deadline, but
    not the 3 s target: the prompt is prefilled on the decode worker despite its stall of 32
    streams (cost 9 s against remote's 4.8 s)."""
    decode = WorkerLoad(running=32, prefill_tokens_per_s=1000.0, decode_step_s=0.08)
    pool = WorkerLoad(prefill_tokens_per_s=300.0, queued_tokens=1200)
    assert _route(decode, pool, 200, target_s=30.0) is Route.REMOTE
    assert _route(decode, pool, 200, target_s=RouterPolicy().ttft_target_s(
        LatencyClass.STANDARD, 30.0)) is Route.LOCAL


def test_a_prefill_worker_on_the_decode_workers_cpus_stalls_its_streams() -> None:
    """`pdserve cluster up`: the prefill worker runs on every CPU the decode worker has, at a
    lower priority and so slower. A short prompt to a decode worker with running streams:
    remote used to look free of stall and went there; computed on the same cores, it is not,
    and local (faster, no transfer) wins. On a host of its own the prefill worker still takes
    it."""
    busy = WorkerLoad(running=3, prefill_tokens_per_s=2000.0, decode_step_s=0.02,
                      waiting_prompt_tokens=200.0)
    pool = WorkerLoad(prefill_tokens_per_s=1000.0, kv_transfer_s_per_token=1e-5)
    ids = list(range(2000, 2200))
    here = ("h1", (0, 1))
    for prefill_where, route in ((here, Route.LOCAL), (("h2", (0, 1)), Route.REMOTE),
                                 (("", ()), Route.REMOTE)):
        decoders = [_worker("d0", "decode", busy, here)]
        prefills = [_worker("p0", "prefill", pool, prefill_where)]
        p = place(ids, LatencyClass.STANDARD, decoders, prefills, KVIndex(), {},
                  RouterPolicy(placement="cost"), cost=MODEL, target_s=3.0)
        assert p.decision.route is route, prefill_where
    d0 = _worker("d0", "decode", busy, ("h1", (0,)))
    assert not _worker("p0", "prefill", pool, ("h1", (1,))).shares_cpus(d0)  # pinned apart
    assert _worker("p0", "prefill", pool, ("h1", ())).shares_cpus(d0)  # CPUs unknown
    assert not _worker("p0", "prefill", pool, ("", ())).shares_cpus(
        _worker("d1", "decode", busy, ("", ())))  # hosts unknown: nothing shared


def test_a_lower_priority_prefill_worker_stalls_a_third_as_much() -> None:
    """`pdserve cluster up --prefill 1 --decode 2`: the prefill worker shares the decode
    workers' CPUs at nice 5, so it takes a quarter of a CPU both want (the kernel's weights:
    1.25x a nice step) and the decode steps it meets take a third longer. A 250-token batch
    prompt, eight streams running on w, the prefill worker busy with another prompt: at
    equal priority a remote prefill stalls w's streams as much as a local one and only
    arrives later, so local wins; at nice 5 remote stalls them a third as much and wins,
    later to its first token but well inside the batch target."""
    here = ("h1", (0, 1))
    d = _worker("d0", "decode", WorkerLoad(running=8, prefill_tokens_per_s=290.0,
                                           decode_step_s=0.03), ("h1", (0,)))
    p0 = WorkerLoad(prefill_tokens_per_s=250.0, queued_tokens=1100.0,
                    kv_transfer_s_per_token=1e-5)
    ids = list(range(5000, 5250))
    routes = {}
    for nice in (0, 5):
        p = _worker("p0", "prefill", p0, here, nice)
        assert p.stall_share(d) == pytest.approx(1.0 if nice == 0 else 1.25 ** -5)
        routes[nice] = place(ids, LatencyClass.BATCH, [d], [p], KVIndex(), {},
                             RouterPolicy(placement="cost"), cost=MODEL,
                             target_s=15.0).decision.route
    assert routes == {0: Route.LOCAL, 5: Route.REMOTE}
    assert _worker("p0", "prefill", p0, here, -3).stall_share(d) == 1.0  # at most 1
    assert _worker("p0", "prefill", p0, ("h2", ()), 5).stall_share(d) == 0.0


def test_a_batch_prompt_waits_for_the_prefill_worker_rather_than_stall_streams() -> None:
    """`pdserve cluster up --prefill 1 --decode 2` at 1.2 req/s (docs/bench/placement_s62):
    the prefill worker busy with two 1,146-token batch prompts, a third arrives at a decode
    worker running four streams. Remote is predicted past the batch target (15 s), local in
    4 s; priced like an interactive prompt's (weight 1) the wait loses to the stall and the
    prompt is prefilled beside the streams. At the batch weight (a tenth) it queues for
    the prefill worker (31 s, within its 120 s deadline), unless that queue is three times as
    long; an interactive prompt of that length goes local."""
    d = _worker("d0", "decode", WorkerLoad(running=4, prefill_tokens_per_s=290.0,
                                           decode_step_s=0.06), ("h1", (0,)))
    p = _worker("p0", "prefill", WorkerLoad(prefill_tokens_per_s=110.0, queued_tokens=2292.0,
                                            kv_transfer_s_per_token=1e-5), ("h1", (0, 1)), 5)
    ids = list(range(7000, 8146))

    def route(cls: LatencyClass, **weights: float) -> Route:
        policy = RouterPolicy(placement="cost", ttft_weights={
            LatencyClass(k): v for k, v in weights.items()})
        return place(ids, cls, [d], [p], KVIndex(), {}, policy, cost=MODEL,
                     target_s=policy.ttft_target_s(cls, 120.0)).decision.route

    assert route(LatencyClass.BATCH, batch=1.0) is Route.LOCAL
    assert route(LatencyClass.BATCH) is Route.REMOTE  # the default: a tenth
    p = p.with_load(dataclasses.replace(p.load, queued_tokens=3 * 2292.0))
    assert route(LatencyClass.BATCH) is Route.LOCAL
    assert route(LatencyClass.INTERACTIVE) is Route.LOCAL
    with pytest.raises(ValueError, match="TTFT weight of batch"):
        RouterPolicy(ttft_weights={LatencyClass.BATCH: 0.0})


def test_an_adapting_prefill_worker_is_priced_by_the_threads_a_prompt_gets() -> None:
    """`pdserve cluster up`'s prefill worker (two threads, `--adapt-threads`) computes a
    prompt under `LONG_STEP_TOKENS` on one thread even on an idle host, a longer one on a
    thread per free CPU: priced at the rate it measured scaled by those threads over the
    share of its CPUs it measured on (on one thread of two: half), not at its last rate
    (which an idle cluster predicted up to 1.9x fast for a short prompt, stop 75). Its
    record carries what it runs (`WorkerInfo.threads`, `adapt_threads`)."""
    assert cpu_factor(1.0, 2, [], threads=2, adapt=True, long_prompt=False) == 0.5
    assert cpu_factor(0.5, 2, [], threads=2, adapt=True, long_prompt=False) == 1.0
    assert cpu_factor(0.5, 2, [], threads=2, adapt=True) == 2.0  # measured on one thread
    assert cpu_factor(1.0, 2, [], threads=2, adapt=True) == 1.0
    assert cpu_factor(1.0, 2, [], threads=2) == 1.0  # fixed threads: its measured rate
    assert cpu_factor(1.0, 2, [0.25], threads=2, adapt=True) == 0.5  # one free CPU
    assert cpu_factor(1.0, 2, [0.25, 0.25], threads=2, adapt=True) == 0.125  # a quarter
    assert cpu_factor(0.125, 2, [0.25, 0.25], threads=2, adapt=True) == 1.0  # measured so
    # Slowed for the horizon, then at its idle factor (two threads: 2 s at a quarter, then
    # 4 s of measured-rate work at twice the rate).
    assert contended_factor(0.25, 4.5, 2.0, after=2.0) == pytest.approx(4.5 / 4.0)
    assert contended_factor(2.0, 4.5, 2.0, after=2.0) == 2.0

    def ttft(n: int, share: float, adapt: bool = True) -> float:
        pool = WorkerLoad(prefill_tokens_per_s=1000.0, kv_transfer_s_per_token=1e-6,
                          prefill_cpu_share=share)
        slow = WorkerLoad(running=0, prefill_tokens_per_s=10.0, decode_step_s=0.02)
        p = place(list(range(5000, 5000 + n)), LatencyClass.STANDARD,
                  [_worker("d0", "decode", slow, ("h2", (0,)))],
                  [_worker("p0", "prefill", pool, ("h1", (0, 1)), 5, 2, adapt)],
                  KVIndex(), {}, RouterPolicy(placement="cost"), cost=MODEL)
        assert p.decision.route is Route.REMOTE and p.decision.predicted_ttft_s is not None
        return p.decision.predicted_ttft_s - MODEL.remote_overhead_s - 0.02 - n * 1e-6

    assert ttft(200, 1.0) == pytest.approx(0.4)  # one thread of the two it measured on
    assert ttft(200, 1.0, adapt=False) == pytest.approx(0.2)
    assert ttft(400, 1.0) == pytest.approx(0.4)
    assert ttft(400, 0.5) == pytest.approx(0.2)  # two threads; it measured on one
    info = _worker("p0", "prefill", WorkerLoad(), ("h1", (0, 1)), 5, 2, True)
    assert WorkerInfo.from_json(info.to_json()) == info
    for bad in ({"threads": -1}, {"threads": True}, {"adapt_threads": 1}):
        with pytest.raises(WorkerInfoError):
            WorkerInfo.from_dict({**json.loads(info.to_json()), **bad})


def test_a_prefill_worker_whose_cpus_busy_decode_workers_want_is_priced_at_its_share() -> None:
    """`pdserve cluster up --prefill 1 --decode 2`: the decode workers pinned to CPU 0 and 1,
    the prefill worker on both at nice 5. With a stream running on each decode worker, a
    short interactive prompt sent remote got a quarter of a CPU: 1.4 s for 122 tokens where
    it takes 0.3 s on a free one (docs/bench/placement_s64). Priced at that share (one
    thread, as it adapts: `EngineConfig.adapt_threads`) it stays local; with a third CPU
    free it runs one thread there, at a third of a rate it measured on all three (local
    still) or at the whole of one it measured on one thread (remote wins as before); a rate
    the prefill worker measured beside the same busy workers (`prefill_cpu_share`) is
    already slow and is not slowed again. A 1,146-token batch prompt is slowed only for
    the seconds the busy workers are expected to stay so (`contention_horizon_s`): it
    still goes remote rather than hold a decode worker's CPU for seconds."""
    busy = WorkerLoad(running=1, prefill_tokens_per_s=450.0, decode_step_s=0.045)

    def placed(cpus: tuple[int, ...], measured_share: float | None = None, n: int = 122,
               cls: LatencyClass = LatencyClass.INTERACTIVE, rate: float = 450.0,
               model: CostModel = MODEL) -> placement.Placement:
        ids = list(range(9000, 9000 + n))
        pool = WorkerLoad(prefill_tokens_per_s=rate, kv_transfer_s_per_token=1e-4,
                          prefill_cpu_share=measured_share)
        decoders = [_worker("d0", "decode", busy, ("h1", (0,))),
                    _worker("d1", "decode", busy, ("h1", (1,)))]
        prefills = [_worker("p0", "prefill", pool, ("h1", cpus), 5)]
        policy = RouterPolicy(placement="cost")
        return place(ids, cls, decoders, prefills, KVIndex(), {}, policy, cost=model,
                     target_s=policy.ttft_target_s(cls, 120.0))

    def route(cpus: tuple[int, ...], measured_share: float | None = None) -> Route:
        return placed(cpus, measured_share).decision.route

    assert route((0, 1, 2)) is Route.LOCAL
    assert route((0, 1, 2), measured_share=1 / 3) is Route.REMOTE
    assert route((0, 1)) is Route.LOCAL
    assert route((0, 1), measured_share=0.125) is Route.REMOTE
    batch = placed((0, 1), n=1146, cls=LatencyClass.BATCH, rate=260.0)
    throughout = placed((0, 1), n=1146, cls=LatencyClass.BATCH, rate=260.0,
                        model=dataclasses.replace(MODEL, contention_horizon_s=math.inf))
    assert batch.decision.route is Route.REMOTE
    assert batch.decision.predicted_ttft_s is not None
    assert batch.decision.predicted_ttft_s < 7.0
    # Priced at one thread's quarter of a CPU throughout it would take ~35 s remote.
    assert throughout.decision.route is Route.LOCAL
    assert contended_factor(0.25, 0.3, 2.0) == 0.25  # within the horizon: the share
    assert contended_factor(0.25, 4.5, 2.0) == pytest.approx(4.5 / 6.0)
    assert contended_factor(1.0, 4.5, 2.0) == 1.0
    p0 = _worker("p0", "prefill", PREFILL, ("h1", (0, 1)), 5)
    d0 = _worker("d0", "decode", busy, ("h1", (0,)))
    assert p0.cpu_share_beside(d0) == pytest.approx(1 / (1 + 1.25 ** 5))
    assert _worker("p1", "prefill", PREFILL, ("h2", ()), 5).cpu_share_beside(d0) == 1.0
    assert cpu_factor(None, 2, [0.25]) == 0.5  # one CPU is free: one thread of two
    assert cpu_factor(0.5, 2, [0.25]) == 1.0  # measured on one thread already
    assert cpu_factor(None, 2, [0.25, 0.5]) == 0.25  # one thread beside the lighter claim
    assert cpu_factor(0.125, 2, [0.25, 0.25]) == 1.0  # measured so
    assert cpu_factor(None, 2, [0.25], busy_cpus=2) == 0.125  # one busy on both its CPUs
    assert cpu_factor(None, 2, []) == 1.0  # nothing busy beside it: its measured rate
    assert cpu_factor(None, 0, [0.25]) == 1.0  # its CPUs unknown: nothing assumed
    assert cpu_factor(None, 2, [0.25], threads=1) == 1.0  # its one thread finds the free CPU
    d01 = _worker("d01", "decode", busy, ("h1", (0, 1)))
    assert (p0.cpus_shared(d0), p0.cpus_shared(d01)) == (1, 2)
    assert p0.cpus_shared(_worker("d", "decode", busy, ("h2", (0,)))) == 0
    assert p0.cpus_shared(_worker("d", "decode", busy, ("h1", ()))) == 1  # unknown: one
