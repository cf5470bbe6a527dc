"""Routing decisions: pure functions, no I/O."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.control.load import WorkerLoad
from pdserve.control.workers import WorkerInfo
from pdserve.types import LatencyClass, PrefillReport, StageTimings
from router import placement
from router.kv_index import KVIndex
from router.ledger import PlacementLedger
from router.placement import DecodeTable, best_of, least_backlog, place
from router.policy import (
    DecodeCandidate,
    Route,
    RouterPolicy,
    best_decode,
    choose_decode,
    decide_route,
)
from router.timings import StageClock

POLICY = RouterPolicy(remote_min_uncached_tokens=256, max_prefill_backlog_tokens=4096)


def test_long_uncached_prompt_goes_remote() -> None:
    d = decide_route(2000, 0, LatencyClass.STANDARD, 0, POLICY)
    assert (d.route, d.reason, d.uncached_tokens) == (Route.REMOTE, "long_uncached_prompt", 2000)


def test_short_prompt_stays_local() -> None:
    d = decide_route(100, 0, LatencyClass.INTERACTIVE, 0, POLICY)
    assert (d.route, d.reason) == (Route.LOCAL, "short_prompt")


def test_long_prompt_with_cached_prefix_stays_local() -> None:
    d = decide_route(2000, 1920, LatencyClass.STANDARD, 0, POLICY)
    assert (d.route, d.reason, d.uncached_tokens) == (Route.LOCAL, "cached_prefix", 80)


def test_no_prefill_worker_or_backlog_keeps_prefill_local() -> None:
    assert decide_route(2000, 0, LatencyClass.STANDARD, None, POLICY).reason == \
        "no_prefill_worker"
    assert decide_route(2000, 0, LatencyClass.STANDARD, 5000, POLICY).reason == \
        "prefill_backlog"


def test_batch_requests_yield_the_prefill_pool_first() -> None:
    backlog = 3000  # under the limit, over the batch share of it
    assert decide_route(2000, 0, LatencyClass.INTERACTIVE, backlog, POLICY).route is Route.REMOTE
    assert decide_route(2000, 0, LatencyClass.BATCH, backlog, POLICY).route is Route.LOCAL


def _cand(wid: str, cached: int, running: float, free: float = 100) -> DecodeCandidate:
    return DecodeCandidate(wid, cached, running, 0, free, 100)


def _decoder(wid: str, running: float) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role="decode", grpc_address="127.0.0.1:1", model_id="m",
                      epoch=1, started_at=0.0,
                      load=WorkerLoad(running=running, free_blocks=100, total_blocks=100))


@pytest.mark.parametrize("policy", ["threshold", "cost"])
def test_requests_that_ended_since_a_heartbeat_do_not_make_their_worker_look_busy(
        policy: str) -> None:
    """Two closed-loop streams on two decode workers (docs/bench/placement_s79): both of
    a's requests end together and their next two arrive before a's next heartbeat, which
    still counts the two. Taken off it (`PlacementLedger.finished`), the two arrivals go one
    to each worker; counted (the router before), both went to b, then both back to a."""
    now = [0.0]
    ledger = PlacementLedger(lambda: now[0])
    a, b = _decoder("a", 2), _decoder("b", 0)
    rp = RouterPolicy(placement=policy)  # type: ignore[arg-type]
    ledger.place("r1", "a")
    ledger.place("r2", "a")
    now[0] = 1.0
    ledger.saw_loads([("a", a.load), ("b", b.load)], 0.35)  # taken at 0.65 or later
    now[0] = 1.5
    ledger.release("r1")
    ledger.release("r2")
    assert ledger.finished == {"a": 2} and not ledger.placed

    def choose(finished: dict[str, int]) -> str:
        p = place(list(range(100)), LatencyClass.INTERACTIVE, [a, b], [], KVIndex(),
                  ledger.placed, rp, tiebreak=1, finished=finished)
        return p.decode.worker_id

    first = choose(ledger.finished)
    ledger.place("r3", first)
    second = choose(ledger.finished)
    assert {first, second} == {"a", "b"}
    assert choose({}) == "b"  # without: b looks idler as long as a's heartbeat is stale

    ledger.place("r4", second)
    ledger.release("r3")  # placed after a's load was taken: that load never counted it
    ledger.release("r4")
    assert ledger.finished == {"a": 2}
    ledger.saw_loads([("a", a.load), ("b", b.load)], 0.35)  # the same loads: nothing new
    assert ledger.finished == {"a": 2}
    ledger.saw_loads([("a", _decoder("a", 0).load), ("b", b.load)], 0.35)  # a's next one
    assert not ledger.finished
    ledger.place("r5", "b")
    now[0] = 3.0
    ledger.saw_loads([("b", _decoder("b", 1).load)], 0.35, complete=False)
    ledger.release("r5")
    assert ledger.finished == {"b": 1}
    ledger.saw_loads([("a", a.load)], 0.35)  # b has left the directory: forgotten
    assert not ledger.finished


def test_choose_decode_prefers_less_load() -> None:
    best = choose_decode([_cand("a", 0, 10), _cand("b", 0, 1)], 500, POLICY)
    assert best.worker_id == "b"


def test_choose_decode_prefers_cache_affinity_over_small_load_gap() -> None:
    best = choose_decode([_cand("a", 480, 5), _cand("b", 0, 4)], 500, POLICY)
    assert best.worker_id == "a"


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 6), st.integers(0, 6),
                               st.integers(0, 8), st.sampled_from([0, 8]), st.integers(0, 8)),
                     min_size=1, max_size=40),
       prompt_len=st.integers(0, 4000), tiebreak=st.integers(0, 10**6),
       affinity=st.sampled_from([0.0, 2.0, 7.5]),
       gone=st.lists(st.integers(0, 7), min_size=0, max_size=40))
def test_the_routers_array_scoring_equals_best_decode(
        rows: list[tuple[int, int, int, int, int, int]], prompt_len: int, tiebreak: int,
        affinity: float, gone: list[int]) -> None:
    """router.placement scores decode workers as arrays (the router's hot path); it must pick
    exactly what the reference `best_decode` picks, ties and the tie-break included, with the
    router's own placed counts taken as running, and its requests that left a worker since
    its heartbeat taken off that heartbeat's count (`finished`, no lower than 0)."""
    policy = RouterPolicy(affinity_weight=affinity)
    decoders = [WorkerInfo(worker_id=f"d{i}", role="decode", grpc_address="127.0.0.1:1",
                           model_id="m", epoch=1, started_at=0.0,
                           load=WorkerLoad(running=r, waiting=q, free_blocks=min(f, t),
                                           total_blocks=t))
                for i, (_, r, q, f, t, _) in enumerate(rows)]
    placed = {f"d{i}": p for i, (*_, p) in enumerate(rows) if p}
    finished = {f"d{i}": x for i, x in enumerate(gone[:len(rows)]) if x}
    cols = DecodeTable().columns(decoders, KVIndex())
    cached = np.array([float(c) for c, *_ in rows])
    ref = [(c, max(r - finished.get(f"d{i}", 0), placed.get(f"d{i}", 0), 0), w.load.backlog,
            min(f, t), t)
           for i, ((c, r, _, f, t, _), w) in enumerate(zip(rows, decoders, strict=True))]
    want = best_decode(ref, prompt_len, policy, tiebreak)
    assert best_of(cols, cached, placed, prompt_len, policy, tiebreak, finished) == want
    weight = affinity / max(prompt_len, 1)  # the numpy fallback too, where C is built
    assert placement._best_of_numpy(cols, cached, placed, weight, tiebreak, finished) == want


def _load(rng: np.random.Generator) -> WorkerLoad:
    total = int(rng.choice([0, 64]))
    return WorkerLoad(running=int(rng.integers(8)), waiting=int(rng.integers(8)),
                      free_blocks=int(rng.integers(total + 1)), total_blocks=total,
                      prefill_tokens_per_s=float(rng.choice([0.0, 800.0, 1234.5])),
                      decode_step_s=float(rng.choice([0.0, 0.03])),
                      queued_tokens=int(rng.integers(3)) * 100)


def test_heartbeats_rewrite_only_their_rows_and_equal_a_rebuild() -> None:
    """The router's cached columns after a stream of heartbeats (each replaces one worker's
    record: its row is rewritten in new arrays), workers leaving and joining, equal columns
    built from scratch; the columns handed out before a change stay as they were."""
    rng = np.random.default_rng(5)
    index, table = KVIndex(), DecodeTable()
    workers = [WorkerInfo(worker_id=f"d{i}", role="decode", grpc_address="127.0.0.1:1",
                          model_id="m", epoch=1, started_at=0.0, load=_load(rng))
               for i in range(12)]
    for step in range(300):
        before = table.columns(workers, index)
        kept = before.running.copy()
        if step % 50 == 49:
            workers = workers[1:]  # a worker left: a full rebuild
        else:
            for i in rng.choice(len(workers), size=int(rng.integers(1, 3)), replace=False):
                workers[i] = dataclasses.replace(workers[i], load=_load(rng))
        got = table.columns(workers, index)
        want = placement._build(workers, index)
        for name in (*placement._FLOAT_COLUMNS, "ids", "groups", "min_rate"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), (step, name)
        assert got.workers == tuple(workers) and np.array_equal(before.running, kept)


def test_a_named_listing_is_answered_by_its_name_and_a_new_name_sees_the_change() -> None:
    """The router names its lists of workers by its directory's generation: while the name
    holds, the columns are handed back without a pass over the workers; a new name (or
    none, as for a retry's list without the failed worker) brings the change in, rows
    rewritten as without names."""
    rng = np.random.default_rng(7)
    index, table = KVIndex(), DecodeTable()
    workers = [WorkerInfo(worker_id=f"d{i}", role="decode", grpc_address="127.0.0.1:1",
                          model_id="m", epoch=1, started_at=0.0, load=_load(rng))
               for i in range(12)]
    first = table.columns(workers, index, listing=(1, False, 0))
    assert table.columns(list(workers), index, listing=(1, False, 0)) is first
    for generation in range(2, 60):
        if generation % 10 == 0:
            workers = workers[1:]  # a worker left: a full rebuild
        else:
            i = int(rng.integers(len(workers)))
            workers[i] = dataclasses.replace(workers[i], load=_load(rng))  # its heartbeat
        named = generation % 3 != 0  # every third list is a retry's, unnamed
        listing = (generation, False, 0) if named else None
        got = table.columns(workers, index, listing=listing)
        want = placement._build(workers, index)
        for name in (*placement._FLOAT_COLUMNS, "ids", "min_rate"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), (generation, name)
        if named:
            assert table.columns(workers, index, listing=listing) is got


def test_the_c_scoring_is_built_and_checks_its_input() -> None:
    """setup.py builds router/_score.c (the router's hot path; optional only where no
    compiler exists); wrong buffers are refused, not read past their end."""
    from router._score import best
    ones = np.ones(3)
    assert best(ones, ones, ones, ones, ("a", "b", "c"), {}, 1.0, 1) == 1
    assert best(ones, ones, ones, np.array([0.0, 0.0, 5.0]), ("a", "b", "c"), {}, 1.0, 0) == 2
    with pytest.raises(ValueError, match="ids"):
        best(ones, ones, ones, np.ones(2), ("a", "b", "c"), {}, 1.0, 0)
    with pytest.raises(TypeError, match="float64"):
        best(ones, ones, ones, np.ones(3, dtype=np.float32), ("a", "b", "c"), {}, 1.0, 0)
    with pytest.raises(ValueError, match="no decode"):
        best(np.ones(0), np.ones(0), np.ones(0), np.ones(0), (), {}, 1.0, 0)


def test_the_prefill_worker_choice_counts_in_flight_prompts_and_takes_turns() -> None:
    """Threshold placement's prefill choice: the router's own in-flight prompt tokens count
    (a burst between heartbeats does not all go to one), and equal workers take turns."""
    prefills = [WorkerInfo(worker_id=f"p{i}", role="prefill", grpc_address="127.0.0.1:1",
                           model_id="m", epoch=1, started_at=0.0, load=WorkerLoad())
                for i in range(4)]
    chosen = [least_backlog(prefills, {}, t) for t in range(8)]
    assert [w.worker_id for w in chosen if w] == ["p0", "p1", "p2", "p3"] * 2
    busy = {"p0": 900.0, "p1": 100.0, "p2": 500.0}
    assert [least_backlog(prefills, busy, t).worker_id for t in range(4)] == ["p3"] * 4  # type: ignore[union-attr]
    assert least_backlog([], busy) is None


def test_stage_timings_add_up_to_ttft_on_every_route() -> None:
    stages = ("route_ms", "decode_allocate_ms", "queued_ms", "prefill_compute_ms",
              "kv_transfer_ms", "handoff_ms", "remote_attempt_ms", "local_prefill_ms")

    def total(t: StageTimings) -> float:
        return sum(getattr(t, k) or 0.0 for k in stages)

    remote = StageClock(time.monotonic())
    remote.routed()
    remote.allocated()
    time.sleep(0.005)
    remote.prefilled(PrefillReport("p", 0.5, 1.0, 0.5, 1, 1))
    remote.first_token()
    t = remote.finish()
    assert t.first_token_ms is not None and t.total_ms is not None and t.handoff_ms
    assert total(t) == pytest.approx(t.first_token_ms) and t.first_token_ms <= t.total_ms
    assert t.queued_ms == 0.5 and t.kv_bytes == 1.0

    # Fell back, then the decode worker went away and a second placement ran locally: the
    # first attempt counts as routing, never as a negative stage.
    retried = StageClock(time.monotonic())
    retried.routed()
    retried.allocated()
    retried.fell_back()
    retried.routed()
    retried.first_token()
    t = retried.finish()
    shown = t.to_json()
    assert set(shown) == {"route_ms", "local_prefill_ms", "ttft_ms", "total_ms"}
    assert min(shown.values()) >= 0 and total(t) == pytest.approx(shown["ttft_ms"])


def test_cached_tokens_per_position_follow_each_workers_geometry() -> None:
    """What placement reads from the index per candidate (`_cached`, gathered by index slot):
    each worker's held prefix in its own block size and model, nothing for a worker the index
    has not synced or does not follow, over more than 64 slots, and in any list order."""
    from pdserve.engine.block_manager import block_hashes
    from pdserve.kv_events import KVEventBatch, KVOp

    rng = np.random.default_rng(11)
    ids = [int(t) for t in rng.integers(0, 1000, size=16 * 20)]
    index = KVIndex()
    want: dict[str, int] = {}
    workers = []
    for i in range(80):
        bs, model = (16, "m") if i % 3 else (8, "n")
        depth = int(rng.integers(0, 15))
        wid = f"d{i}"
        if i % 7 != 3:  # every seventh is not followed: it holds nothing
            ops = tuple((KVOp.STORED, h) for h in block_hashes(ids, bs, model.encode())[:depth])
            index.apply(wid, KVEventBatch(1, 0, bs, ops, snapshot=True))
            want[wid] = depth * bs
        workers.append(WorkerInfo(worker_id=wid, role="decode", grpc_address="127.0.0.1:1",
                                  model_id=model, epoch=1, started_at=0.0))
    index.remove_worker("d40")  # left: its slot is free, and it holds nothing
    want.pop("d40", None)
    rng.shuffle(workers)
    from router import kv_index
    saved = kv_index._native_match, kv_index._native_spread
    for native in (True, False):  # and where the C was not built
        if not native:
            kv_index._native_match = kv_index._native_spread = None
        try:
            (cached,) = placement._cached(index, ids, DecodeTable().columns(workers, index))
            assert cached.tolist() == [float(want.get(w.worker_id, 0)) for w in workers]
            assert placement.cached_tokens(index, ids, workers) == [
                want.get(w.worker_id, 0) for w in workers]
        finally:
            kv_index._native_match, kv_index._native_spread = saved
