"""The cluster simulator (bench.cluster_sim, bench/sim/): it places with the router's own code,
is deterministic, loses no request and no KV block, and prices an idle request exactly as the
step-cost profile says."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import router.placement
from bench.cluster_sim import (
    GOODPUT_ROUTER,
    MIXED_SLO,
    Unloaded,
    calibrate,
    record_adapts,
    record_engine,
    record_threads,
    trace_chat,
    trace_mixed,
)
from bench.sim.cluster import Overheads, SimConfig, SimResult, Simulation, simulate
from bench.sim.workers import (
    DECODE_ONE,
    Host,
    SimRequest,
    SimWorker,
    StepCost,
    corun_slowdown,
    load_corun,
)
from pdserve.engine.free_cpus import WINDOW_S, threads_for
from pdserve.types import LatencyClass
from router.config import RouterConfig

COST = StepCost.load()
OVERHEADS = Overheads(local_s=0.05, remote_s=0.04, step_s=0.01, transfer_s_per_token=1e-4)


def run(policy: str = "threshold", *, n_decode: int = 1, reqs: list[SimRequest] | None = None,
        **kw: Any) -> SimResult:
    kw.setdefault("step_target_ms", 0.0)  # steps priced here are the token budget's
    cfg = SimConfig(n_decode=n_decode, n_prefill=max(1, n_decode // 4), policy=policy,  # type: ignore[arg-type]
                    router=GOODPUT_ROUTER, overheads=kw.pop("overheads", OVERHEADS), **kw)
    return simulate(cfg, reqs if reqs is not None else trace_mixed(30, 0.5, 1), MIXED_SLO, COST)


@pytest.mark.parametrize("policy", ["threshold", "cost"])
def test_places_with_the_routers_own_function(policy: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real = router.placement.place
    calls: list[router.placement.Placement] = []

    def spy(*args: Any, **kwargs: Any) -> router.placement.Placement:
        p = real(*args, **kwargs)
        assert real(*args, **kwargs) == p  # a pure function of what the router sees
        calls.append(p)
        return p

    monkeypatch.setattr(router.placement, "place", spy)
    reqs = trace_mixed(30, 0.8, 2)
    res = run(policy, n_decode=2, reqs=reqs, sharing="cluster-up")
    assert len(calls) == len(reqs)
    assert res.decisions == [(p.decode.worker_id, p.decision.route.value, p.decision.reason)
                             for p in calls]
    if policy == "threshold":  # bench.goodput's rule: remote from 512 uncached tokens
        long = [i for i, r in enumerate(reqs) if len(r.ids) >= 512]
        assert long and all(res.decisions[i][1] == "remote" for i in long)


def test_baselines_do_not_call_place(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("baselines choose the decode worker themselves")

    monkeypatch.setattr(router.placement, "place", boom)
    res = run("round-robin", n_decode=4)
    assert [d for d, _, _ in res.decisions[:8]] == [f"decode-{i % 4:03d}" for i in range(8)]


def test_deterministic_for_a_seed() -> None:
    def fingerprint(r: SimResult) -> list[Any]:
        return [(q.ttft_s, q.e2e_s, q.route) for q in r.requests]

    reqs = trace_chat(120, 6.0, 3, open_conversations=16)
    for policy in ("cost", "random"):
        a, b = run(policy, n_decode=4, reqs=reqs), run(policy, n_decode=4, reqs=reqs)
        assert fingerprint(a) == fingerprint(b) and a.decisions == b.decisions


@pytest.mark.parametrize("policy", ["threshold", "cost", "least-loaded", "random"])
def test_every_request_finishes_and_every_block_is_freed(policy: str) -> None:
    # A small pool and a burst: preemption (recompute) happens, and must lose nothing.
    reqs = trace_chat(150, 30.0, 4, open_conversations=12)
    res = run(policy, n_decode=4, reqs=reqs, num_blocks=400)
    assert res.summary.overall.num_errors == 0
    assert all(q.output_tokens == r.output_len for q, r in zip(res.requests, reqs, strict=True))
    assert res.leaked_blocks == 0
    assert sum(res.routes.values()) == len(reqs)
    assert res.prefix_hit_rate > 0.2  # shared system prompts and growing histories


def _one(n: int, out: int) -> list[SimRequest]:
    return [SimRequest("r0", 0.0, tuple(range(100, 100 + n)), out, LatencyClass.INTERACTIVE)]


def test_idle_local_request_costs_the_profile() -> None:
    n, out, o = 100, 6, OVERHEADS
    q = run("threshold", reqs=_one(n, out)).requests[0]
    assert q.route == "local"
    assert q.ttft_s == pytest.approx(o.local_s + o.step_s + COST.step_s([(0, n)]))
    steps = [o.step_s + COST.step_s([(n + k, 1)]) for k in range(out - 1)]
    assert q.tpot_s == pytest.approx(sum(steps) / len(steps))


@pytest.mark.parametrize("factor", [1.0, 1.3])
def test_idle_remote_request_costs_the_profile(factor: float) -> None:
    # `prefill_factor`: the prefill worker's steps cost that much more than the profile says
    n, out = 1200, 4
    o = dataclasses.replace(OVERHEADS, prefill_factor=factor)
    q = run("threshold", reqs=_one(n, out), overheads=o).requests[0]
    assert q.route == "remote"
    chunks = [o.step_s + factor * COST.step_s([(k, min(512, n - k))]) for k in range(0, n, 512)]
    assert q.ttft_s == pytest.approx(o.remote_s + sum(chunks) + n * o.transfer_s_per_token)
    steps = [o.step_s + COST.step_s([(n + k, 1)]) for k in range(out - 1)]
    assert q.tpot_s == pytest.approx(sum(steps) / len(steps))


def test_context_overhead_prices_each_decode_rows_context() -> None:
    n, out, per_ctx = 100, 6, 4e-6
    o = dataclasses.replace(OVERHEADS, context_s_per_token=per_ctx)
    q = run("threshold", reqs=_one(n, out), overheads=o).requests[0]
    steps = [o.step_s + per_ctx * (n + k) + COST.step_s([(n + k, 1)]) for k in range(out - 1)]
    assert q.tpot_s == pytest.approx(sum(steps) / len(steps))


def test_calibration_splits_decode_overhead_into_per_step_and_per_context_token() -> None:
    step, per_ctx = 0.002, 5e-6
    chat_ctx, batch_n = 100 + 24, 1100

    def tpot_ms(ctx: int) -> float:
        return (COST.step_s([(ctx, 1)]) + step + per_ctx * ctx) * 1e3

    o = calibrate({"chat": Unloaded("chat", 100, 300.0, tpot_ms(chat_ctx)),
                   "long-batch": Unloaded("long-batch", batch_n, 3000.0,
                                          tpot_ms(batch_n + 12))}, COST)
    assert o.context_s_per_token == pytest.approx(per_ctx)
    assert o.step_s == pytest.approx(step)


def test_step_target_takes_smaller_prefill_steps() -> None:
    # Two long prompts at once on one decode worker: with a step target, once the first step
    # measured the prefill rate, each later step takes about rate x target prompt tokens.
    reqs = [SimRequest(f"r{i}", 0.0, tuple(range(1000 * i, 1000 * i + 1500)), 4,
                       LatencyClass.INTERACTIVE) for i in range(2)]
    plain = run("threshold", reqs=reqs, max_num_batched_tokens=4096)
    timed = run("threshold", reqs=reqs, max_num_batched_tokens=4096, step_target_ms=100.0)
    assert timed.summary.overall.num_errors == plain.summary.overall.num_errors == 0
    assert min(q.ttft_s for q in timed.requests) < min(q.ttft_s for q in plain.requests)


class _Busy(SimWorker):
    def __init__(self, core: int | None, weight: float, host: Host, threads: int = 1,
                 speedup: float = 0.0, adapt: bool = False) -> None:
        self.core, self.weight, self.busy, self.threads = core, weight, True, threads
        self.adapt_threads, self.step_long = adapt, True
        self.step_threads, self.others_avg = threads, 0.0
        self.speedup = speedup or threads
        self.step_kind, self.step_rows = "decode", 1
        host.workers.append(self)


def test_cpu_sharing_follows_cfs_weights() -> None:
    host = Host(2)
    d0, d1, p = _Busy(0, 1024.0, host), _Busy(1, 1024.0, host), _Busy(None, 335.0, host)
    s = host.speeds()
    assert s[d0] == pytest.approx(1024 / 1359) and s[d1] == 1.0
    assert s[p] == pytest.approx(335 / 1359)
    d1.busy = False  # an idle core: the unpinned prefill worker gets it whole
    s = host.speeds()
    assert s[d0] == 1.0 and s[p] == 1.0
    slow = Host(2, {("decode", "prefill"): 1.25, ("prefill", "decode"): 2.0})
    d, q = _Busy(0, 1024.0, slow), _Busy(1, 1024.0, slow)
    q.step_kind = "prefill"
    s = slow.speeds()  # two busy cores: each runs slower, by what runs beside it
    assert s[d] == pytest.approx(1 / 1.25) and s[q] == pytest.approx(1 / 2.0)
    slow.corun[(DECODE_ONE, "prefill")] = 1.5  # a one-row step is slowed more
    assert slow.speeds()[d] == pytest.approx(1 / 1.5)
    d.step_rows = 8
    assert slow.speeds()[d] == pytest.approx(1 / 1.25)


def test_an_unpinned_workers_threads_share_every_core() -> None:
    """`pdserve cluster up`'s 1P2D with a two-thread prefill worker at nice 5: while both
    decode workers stream, its threads are entitled to a quarter of each one's core, but
    every parallel region waits for the one that was not scheduled: it advances as one
    thread at a quarter of a CPU (a 1,146-token prompt took as long on two threads as on
    one, docs/bench/placement_s75), and each thread, held at its barriers, uses half its
    quarter, which its decode worker gets. With `barrier=False` (the simulator before stop
    77) it advanced as one thread at half a CPU. Two threads on one core hold each other
    up as well (the records of stop 75's Xeon fit better so: bench.sim.workers.Host); on
    idle cores it runs at its speedup: with perfect scaling twice its one-thread speed."""
    host = Host(2)
    d0, d1 = _Busy(0, 1024.0, host), _Busy(1, 1024.0, host)
    p = _Busy(None, 335.0, host, threads=2)
    quarter = 335 / 1359
    s = host.speeds()
    assert s[d0] == s[d1] == pytest.approx(1024 / 1359 + quarter / 2)
    assert s[p] == pytest.approx(quarter / 2)
    p.speedup = 1.0
    assert host.speeds()[p] == pytest.approx(quarter)
    summed = Host(2, barrier=False)
    for w in (d0, d1, p):
        summed.workers.append(w)
    s = summed.speeds()
    assert s[p] == pytest.approx(2 * quarter) and s[d0] == pytest.approx(1024 / 1359)
    p.speedup = 2.0
    d1.busy = False  # both threads go to the idle core, and wait for each other there
    s = host.speeds()
    assert s[d0] == 1.0 and s[p] == pytest.approx(0.25)
    assert summed.speeds()[p] == pytest.approx(0.5)
    d0.busy = False
    assert host.speeds()[p] == 1.0
    corun = Host(2, {("prefill", "decode"): 2.0, ("decode", "prefill"): 1.25}, barrier=False)
    d, q = _Busy(0, 1024.0, corun), _Busy(None, 335.0, corun, threads=2)
    q.step_kind = "prefill"
    s = corun.speeds()  # both of q's threads on core 1: d computes beside it, not with it
    assert s[d] == pytest.approx(1 / 1.25) and s[q] == pytest.approx(0.5 / 2.0)
    cfg = SimConfig(n_decode=2, sharing="cluster-up", corun={},
                    overheads=dataclasses.replace(OVERHEADS, prefill_speedup=1.1))
    assert (Simulation(cfg, COST).prefills[0].threads,
            Simulation(cfg, COST).prefills[0].speedup) == (2, 1.1)
    one = dataclasses.replace(cfg, prefill_threads=1)
    assert Simulation(one, COST).prefills[0].threads == 1
    assert Simulation(cfg, COST).prefills[0].adapt_threads  # as cluster up starts it
    assert not Simulation(dataclasses.replace(cfg, prefill_adapt=False),
                          COST).prefills[0].adapt_threads


def test_an_adapting_worker_runs_a_thread_per_free_core() -> None:
    """`pdserve cluster up`'s prefill worker from stop 75 on (`--adapt-threads`): beside
    one busy decode worker it runs one thread, on the free core, at its one-thread speed
    (1 / speedup of its full one); beside two, one thread at a quarter of a core (nice 5
    beside nice 0); alone, both (pdserve.engine.free_cpus)."""
    host = Host(2)
    d0, d1 = _Busy(0, 1024.0, host), _Busy(1, 1024.0, host)
    p = _Busy(None, 335.0, host, threads=2, speedup=1.9, adapt=True)
    p.step_threads = 1
    s = host.speeds()  # its one thread goes to core 0
    assert s[d0] == pytest.approx(1024 / 1359) and s[d1] == 1.0
    assert s[p] == pytest.approx(335 / 1359 / 1.9)
    d1.busy = False
    s = host.speeds()
    assert s[d0] == 1.0 and s[p] == pytest.approx(1 / 1.9)
    d0.busy = False
    p.step_threads = 2
    assert host.speeds()[p] == 1.0


def test_an_adapting_worker_sizes_a_step_by_what_others_took_lately() -> None:
    """As the engine's sampler (`FreeCpus`: a moving average over `WINDOW_S`), a decode
    worker that starts to compute takes its core from the prefill worker's next steps only
    once it has computed for about a second, and gives it back as long after it stops;
    the simulator before stop 77 (`window_s=0`) resized at once, in the middle of a step."""
    host = Host(2)
    d0 = _Busy(0, 1024.0, host)
    p = _Busy(None, 335.0, host, threads=2, speedup=1.9, adapt=True)
    p.busy = False
    host.speeds()  # d0 alone computes, on its whole core
    host.advance(1.0)
    assert p.others_avg == pytest.approx(1 - math.exp(-1.0 / WINDOW_S))
    assert threads_for(host.free_cores(p), p.threads) == 2  # a second: not yet
    host.advance(2.0)
    assert threads_for(host.free_cores(p), p.threads) == 1
    d0.busy = False
    host.speeds()
    host.advance(2.3)  # stopped a moment ago: still counted
    assert threads_for(host.free_cores(p), p.threads) == 1
    host.advance(6.0)
    assert threads_for(host.free_cores(p), p.threads) == 2
    instant = Host(2, window_s=0.0)
    for w in (d0, p):
        instant.workers.append(w)
    d0.busy = True
    assert threads_for(instant.free_cores(p), p.threads) == 1
    cfg = SimConfig(n_decode=2, sharing="cluster-up", corun={})
    assert Simulation(cfg, COST).decoders[0].host.window_s == WINDOW_S
    old = dataclasses.replace(cfg, free_window_s=0.0, barrier=False)
    assert not Simulation(old, COST).decoders[0].host.barrier


def test_records_say_whether_the_prefill_worker_adapted() -> None:
    """bench.sim.real's layout names cluster up's prefill flags from stop 75 on."""
    new = {"systems": {"1p2d": {"layout": "LocalCluster 1P2D (... prefill unpinned at nice 5: "
                                          "`--threads 2 --nice 5 --adapt-threads`), workers "
                                          "`--kv-cache-mb 512`"}}}
    old = {"systems": {"1p2d": {"layout": "LocalCluster 1P2D (... nice 5), workers `--x`"}}}
    assert record_adapts(new) and not record_adapts(old)
    assert record_threads(new) == record_threads(old) == 0


def test_scales_to_many_workers() -> None:
    res = run("cost", n_decode=64, reqs=trace_mixed(300, 32.0, 5))
    assert res.summary.overall.num_errors == 0 and res.leaked_blocks == 0
    used = {d for d, _, _ in res.decisions}
    assert len(used) > 32  # load spreads over the fleet


def test_config_is_checked() -> None:
    bad: list[Callable[[], object]] = [
        lambda: SimConfig(policy="best"),  # type: ignore[arg-type]
        lambda: SimConfig(n_decode=0),
        lambda: SimConfig(n_decode=4, sharing="cluster-up"),
    ]
    for make in bad:
        with pytest.raises(ValueError):
            make()
    assert dataclasses.replace(SimConfig(), policy="random").policy == "random"


def test_a_request_that_cannot_finish_is_reported_not_hung() -> None:
    # 64 blocks hold 1024 tokens: a 1200-token prompt never fits on the decode worker.
    reqs = [SimRequest("big", 0.0, tuple(range(1200)), 4, LatencyClass.INTERACTIVE)]
    res = run("least-loaded", reqs=reqs, num_blocks=64, drain_limit_s=30.0)
    assert res.summary.overall.num_errors == 1


def test_prefill_workers_publish_into_the_routers_index() -> None:
    """The simulated prefill workers' caches reach the router's index as the real ones do,
    and cost placement reuses them: remote turns of a conversation find their history on
    the prefill worker."""
    reqs = trace_chat(150, 8.0, 4, open_conversations=12)
    cfg = SimConfig(n_decode=4, n_prefill=1, policy="cost", router=GOODPUT_ROUTER,
                    overheads=OVERHEADS)
    sim = Simulation(cfg, COST)
    res = sim.run(reqs, MIXED_SLO)
    [prefill] = sim.prefills
    assert res.routes.get("remote", 0) > 0 and sim.index.held(prefill.worker_id)
    assert any(prefill.cached_tokens.values())  # a remote prefill found a cached history
    assert 0 < res.prefill_hit_rate <= 1


def test_the_prefill_worker_admits_by_the_real_gate() -> None:
    """The simulated prefill worker runs `prefill_svc.gate`'s rule: with one slot taken by a
    batch prompt, another batch prompt waits and an interactive one starts at once."""
    sim = Simulation(SimConfig(n_decode=1, n_prefill=1, policy="threshold",
                               router=GOODPUT_ROUTER, overheads=OVERHEADS), COST)
    [decode], [prefill] = sim.decoders, sim.prefills
    prefill.gate.limit = 1

    def prompt(rid: str, cls: LatencyClass) -> SimRequest:
        req = SimRequest(rid, 0.0, tuple(range(100, 1300)), 2, cls)
        assert decode.allocate_remote(req) is not None
        return req

    prefill.submit(prompt("b1", LatencyClass.BATCH), 0, decode)
    prefill.submit(prompt("b2", LatencyClass.BATCH), 0, decode)
    prefill.submit(prompt("i1", LatencyClass.INTERACTIVE), 0, decode)
    assert prefill.active == 2 and prefill.gate.num_waiting == 1
    assert prefill.load().queued_tokens == 1200  # b2 waits
    assert set(prefill._jobs) == {"b1", "i1"}  # in its engine


def test_prefill_beside_decode_slows_the_prefill_worker_on_a_shared_host() -> None:
    """`Overheads.prefill_beside_decode` (fitted from probes beside streams) joins the host's
    co-run table, so a 1P1D prefill step slows while the decode worker computes."""
    o = dataclasses.replace(OVERHEADS, prefill_beside_decode=1.2)
    sim = Simulation(SimConfig(sharing="1p1d", overheads=o, corun={}), COST)
    assert sim.prefills[0].host.corun == {("prefill", "decode"): 1.2}
    assert Simulation(SimConfig(sharing="1p1d", overheads=OVERHEADS, corun={}),
                      COST).prefills[0].host.corun == {}


def test_corun_share_scales_a_decode_steps_slowdown_only() -> None:
    """`Overheads.corun_share` (fitted from chat streams on 1P2D) keeps that share of the
    co-run table's slowdown of a decode step; a prefill step's is the probes' to fit."""
    table = {("decode", "decode"): 1.5, (DECODE_ONE, "decode"): 1.6,
             ("decode", "prefill"): 1.1, ("prefill", "decode"): 1.2}
    o = dataclasses.replace(OVERHEADS, corun_share=0.5)
    sim = Simulation(SimConfig(n_decode=2, sharing="cluster-up", overheads=o, corun=table),
                     COST)
    assert sim.decoders[0].host.corun == pytest.approx(
        {("decode", "decode"): 1.25, (DECODE_ONE, "decode"): 1.3,
         ("decode", "prefill"): 1.05, ("prefill", "decode"): 1.2})
    whole = Simulation(SimConfig(n_decode=2, sharing="cluster-up", overheads=OVERHEADS,
                                 corun=table), COST)
    assert whole.decoders[0].host.corun == table


def test_a_decode_steps_corun_slowdown_follows_its_rows(tmp_path: Path) -> None:
    """bench.engine_profile --corun's one-row and eight-row decode steps: a step between
    them is slowed by its rows, linearly; without a one-row measurement every decode step
    takes the eight-row one (records made before it)."""
    table = {"corun": {f"{name} beside decode": {"slowdown": x} for name, x in (
        ("decode b=8", 1.1), ("decode b=1", 1.5), ("prefill 512", 1.2))}}
    (tmp_path / "corun.json").write_text(json.dumps(table))
    corun = load_corun(tmp_path / "corun.json")
    assert corun == {("decode", "decode"): 1.1, (DECODE_ONE, "decode"): 1.5,
                     ("prefill", "decode"): 1.2}
    by_rows = [corun_slowdown(corun, "decode", r, "decode") for r in (1, 4, 8, 32)]
    assert by_rows == pytest.approx([1.5, 1.5 - 0.4 * 3 / 7, 1.1, 1.1])
    assert corun_slowdown(corun, "prefill", 1, "decode") == 1.2
    assert corun_slowdown(corun, "decode", 1, "prefill") == 1.0  # not measured: none
    del corun[(DECODE_ONE, "decode")]
    assert corun_slowdown(corun, "decode", 1, "decode") == 1.1


def test_prefill_probes_calibrate_the_prefill_side_from_a_real_record() -> None:
    """The committed 1P1D probes (bench.sim.real prefill): the idle pass gives a KV transfer
    price, a prefill speed and the remote path's fixed cost; the replay beside streams fits
    a slowdown from the grid whose probes land near their measured TTFT."""
    from pathlib import Path

    from bench.cluster_sim import BESIDE_DECODE, fit_prefill_sharing, idle_probes

    records = Path(__file__).resolve().parents[1] / "docs/bench/cluster_sim"
    root = records / "prefill_probe_1p1d_s59"
    cost = StepCost.load(records / "engine_profile_s59.json")
    transfer, factor, fixed, idle = idle_probes(root, cost)
    assert len(idle) == 4 and 0 < transfer < 1e-4 and 0.5 < factor < 2 and 0 <= fixed < 0.5
    o, points = fit_prefill_sharing(root, "1p1d", dataclasses.replace(
        OVERHEADS, transfer_s_per_token=transfer, prefill_factor=factor, remote_s=fixed),
        cost, seed=0)
    assert o.prefill_beside_decode in BESIDE_DECODE and len(points) == len(BESIDE_DECODE)
    best = next(p for p in points if p["prefill_beside_decode"] == o.prefill_beside_decode)
    assert best["mean_squared_log_ratio"] == min(p["mean_squared_log_ratio"] for p in points)


def test_streams_on_1p2d_calibrate_the_corun_share_from_a_real_record() -> None:
    """The committed chat streams on `cluster up`'s 1P2D (bench.sim.real streaming --layout
    1p2d, stop 79's Zen 4): each share of the grid replays every concurrency, and the one
    kept has the least error; the per-token cost fitted before it is kept."""
    from bench.cluster_sim import CORUN_SHARES, calibrate_corun

    root = Path(__file__).resolve().parents[1] / "docs/bench/placement_s79"
    cost = StepCost.load(root / "engine_profile_zen4_32e227d.json")
    table = load_corun(root / "engine_corun_zen4_32e227d.json")
    start = dataclasses.replace(OVERHEADS, token_s=4e-4)
    o, points = calibrate_corun(root / "streaming_1p2d_zen4", start, cost, 0, table)
    assert [p["corun_share"] for p in points] == list(CORUN_SHARES)
    assert o.token_s == start.token_s and o.corun_share in CORUN_SHARES
    best = next(p for p in points if p["corun_share"] == o.corun_share)
    assert best["mean_squared_log_ratio"] == min(p["mean_squared_log_ratio"] for p in points)
    assert set(best["tpot_p50_measured_vs_sim_ms"]) == {2, 4, 8, 12}


def test_kv_that_outlasts_the_decode_workers_lease_falls_back_to_a_local_prefill() -> None:
    """A remote prefill whose KV has not landed when the decode worker's lease (the router's
    --prefill-timeout) runs out is given up, wherever it is (queued at the prefill worker's
    gate, computing, or sending), and prefilled on the decode worker, as the router does:
    every request still ends with its tokens and no block is left held on either worker."""
    # One prompt alone (the prefill worker measures its rate), then seven at once.
    batch = [SimRequest(f"b{i}", 0.0 if i == 0 else 20 + 0.1 * i,
                        tuple(range(1000 + 7 * i, 2200 + 7 * i)), 4, LatencyClass.BATCH)
             for i in range(8)]
    leased = run(reqs=batch, remote_lease_s=3.0, max_remote_lease_s=3.0)
    # The router's: 1.5x the queue's wait, ending there or renewed by each part that lands.
    stretched = run(reqs=batch, remote_lease_s=3.0, lease_renews=False)
    renewed = run(reqs=batch, remote_lease_s=3.0)
    unleased = run(reqs=batch, remote_lease_s=0.0)
    assert unleased.routes == {"remote": 8}
    assert leased.routes == {"fallback": 8}  # even the first: no rate, a 3 s lease
    # Stretched, the seven queued behind one another wait their turn there (1.5x the queue
    # is not always enough: the prediction is made from the rate of one prompt); renewed,
    # one whose chunks keep landing is not cut off at that prediction.
    assert stretched.routes.get("remote", 0) >= 4
    assert renewed.routes.get("remote", 0) > stretched.routes.get("remote", 0)
    assert sum(leased.routes.values()) == 8
    for res in (leased, stretched, renewed, unleased):
        assert res.summary.overall.num_ok == 8 and res.leaked_blocks == 0


@pytest.mark.parametrize("window", [0, 8])
def test_the_simulator_learns_the_remote_overhead_as_the_router_does(window: int) -> None:
    """bench.sim.cluster feeds the router's own RemoteOverhead with each remote request's
    dispatch + hand-off: with the window on it learns, and every request still finishes."""
    cfg = SimConfig(n_decode=2, n_prefill=1, policy="cost", router=GOODPUT_ROUTER,
                    overheads=OVERHEADS, remote_overhead_window=window)
    sim = Simulation(cfg, COST)
    res = sim.run(trace_mixed(60, 2.0, 3), MIXED_SLO)
    assert res.summary.overall.num_ok == 60 and res.leaked_blocks == 0
    learner = sim.remote_overhead
    if window == 0:
        assert learner is None
        return
    assert learner is not None and learner.samples >= 8
    assert learner.offset_s != 0.0


def test_a_records_router_flags_set_the_simulated_learner(tmp_path: Path) -> None:
    """validate replays a record with the router it was made with: no learned remote overhead
    before the flag existed (no `router_extra` in its setup), the flag's value where given,
    the router's default otherwise."""
    def window(setup: dict[str, Any]) -> int:
        (tmp_path / "setup.json").write_text(json.dumps({"setup": setup}))
        return int(record_engine(tmp_path)["remote_overhead_window"])

    assert window({}) == 0
    assert window({"router_extra": "()"}) == RouterConfig().remote_overhead_window
    assert window({"router_extra": "('--remote-overhead-window', '0')"}) == 0
    assert window({"router_extra": "('--remote-overhead-window=8',)"}) == 8


def test_a_records_worker_threads_come_from_its_layout() -> None:
    """The 1P2D records made before stop 74 ran every worker with --threads 1, and their
    replays model that; a record without the flag ran `pdserve cluster up`'s placement."""
    old = "LocalCluster 1P2D (...), workers `--threads 1 --kv-cache-mb 512`, router `--x 1`"
    assert record_threads({"layout": old}) == 1
    assert record_threads({"systems": {"1p2d": {"layout": old}}}) == 1
    assert record_threads({"layout": "LocalCluster 1P2D (...), workers `--kv-cache-mb 512`, "
                                      "router `--threads 3`"}) == 0
    assert record_threads({}) == 0
