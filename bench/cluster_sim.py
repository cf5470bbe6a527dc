"""A discrete-event simulator of a pdserve cluster, to compare placement policies at scale.

    # predicted vs measured on the real runs' own traces (bench.goodput / bench.sim.real):
    python -m bench.cluster_sim validate --real docs/bench/cluster_sim/real_1p1d:1p1d \\
        --real docs/bench/cluster_sim/real_1p2d:1p2d --out docs/bench/cluster_sim/validation.json
    # policies at 8-256 decode workers, mixed and multi-turn chat workloads:
    python -m bench.cluster_sim compare --workers 8,16,64,256 \\
        --out docs/bench/cluster_sim/compare.json

The simulator (bench/sim/) runs the engine's own `Scheduler` and `BlockManager` per worker,
prices each step with the step-cost profile measured on this machine (bench.engine_profile,
docs/bench/cluster_sim/engine_profile.json), and places every request with the router's own
`router.placement.place` (threshold, cost) over stale heartbeat loads and a `KVIndex` fed by
the workers' KV events; least-loaded, random and round-robin pick the decode worker
themselves and decide local vs remote by the threshold rule. Time outside the engine steps
(HTTP, router, RPCs, streaming) is calibrated from each real run's *unloaded* requests
(bench.goodput --calibrate), never from the loaded runs it is compared with.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

from bench import records
from bench.loadgen.arrivals import arrival_times
from bench.loadgen.config import SLO
from bench.loadgen.metrics import GroupSummary, Percentiles, RequestResult, goodput
from bench.loadgen.workload import build_requests, named_workload
from bench.sim.cluster import POLICIES, Overheads, Policy, SimConfig, SimResult, simulate
from bench.sim.workers import BLOCK_BYTES, SimRequest, StepCost, load_corun
from pdserve.engine.free_cpus import WINDOW_S
from pdserve.types import LatencyClass
from router.config import RouterConfig
from router.policy import RouterPolicy

# bench.goodput's mixed SLOs (docs/bench/goodput: TTFT 1500 ms / TPOT 150 ms, batch 15 s).
STALL_S = 0.15  # a gap between two tokens this long counts as a stall (per-request rows)
MIXED_SLO = SLO(ttft_ms=1500.0, tpot_ms=150.0, target=0.9, per_class=(("batch", 15000.0, 150.0),))
# bench.goodput's router flags: remote prefill from 512 uncached tokens, no backlog limit.
GOODPUT_ROUTER = RouterPolicy(remote_min_uncached_tokens=512,
                              max_prefill_backlog_tokens=1_000_000)
# median kv_transfer_ms / prompt tokens of goodput_placement run3, before the KV was sent while
# the prompt computes: the default where no --prefill-probe measures it (8e-6 on stop 59's)
TRANSFER_S_PER_TOKEN = 8.7e-5


# --------------------------------------------------------------------------- traces


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, 40000) for _ in range(n))


def trace_from_record(path: Path, seed: int = 0) -> tuple[list[SimRequest], dict[str, Any]]:
    """A real run's requests (bench.loadgen per-rate JSON) as they were sent: arrival, prompt
    and output lengths, latency class. Prompt ids are drawn at random: the loadgen's
    synthetic prompts are random words, so no two share a block either."""
    rec = records.read_json(path)
    rng = random.Random(seed)
    reqs = [SimRequest(f"r{r['index']}", float(r["start_s"]), _ids(rng, int(r["prompt_tokens"])),
                       max(1, int(r["output_tokens"] or r["max_tokens"])),
                       LatencyClass(r["latency_class"]))
            for r in rec["requests"]]
    return sorted(reqs, key=lambda r: r.arrival_s), rec


def trace_mixed(n: int, rate: float, seed: int, workload: str = "mixed-cpu"
                ) -> list[SimRequest]:
    """bench.loadgen's workload and Poisson arrivals, as bench.goodput sends them."""
    rng = random.Random(seed)
    specs = build_requests(named_workload(workload), n, seed)
    times = arrival_times(n, rate, 1.0, seed)
    return [SimRequest(f"r{s.index}", float(t), _ids(rng, s.prompt_len), s.output_len,
                       LatencyClass(s.latency_class), s.class_name)
            for s, t in zip(specs, times, strict=True)]


def trace_chat(n: int, rate: float, seed: int, open_conversations: int) -> list[SimRequest]:
    """Multi-turn chat from bench.router_scale's corpus generator (32 shared system prompts,
    conversations of 3-8 turns whose histories grow), interactive class, scaled to what this
    CPU's profile serves in an interactive TTFT: system prompts of 150-400 tokens (router_scale:
    300-800), user turns of 30-120 (50-200), replies of 30-100 (100-300), prompts up to 2000
    tokens (4000)."""
    from bench.router_scale import ChatSpec, chat_stream, make_systems

    rng = random.Random(seed)
    systems = make_systems(rng, 32, 150, 400)
    spec = ChatSpec(turns=(3, 8), user=(30, 120), assistant=(30, 100), max_prompt=2000)
    stream = chat_stream(rng, systems, spec, open_conversations)
    times = arrival_times(n, rate, 1.0, seed)
    return [SimRequest(f"r{i}", float(t), tuple(c.conv.tokens[:c.prompt_len]),
                       c.full_len - c.prompt_len, LatencyClass.INTERACTIVE, "chat")
            for i, (c, t) in enumerate(zip(itertools.islice(stream, n), times, strict=True))]


# --------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Unloaded:
    request_class: str
    prompt_tokens: float
    ttft_ms: float
    tpot_ms: float


def read_unloaded(comparison_md: Path, system: str) -> dict[str, Unloaded]:
    """bench.goodput's "Unloaded" table rows of one system (p50s), by request class."""
    out = {}
    pat = re.compile(rf"^\| {re.escape(system)} \| ([\w-]+) \((\w+)\) \| (\d+) \| ([\d.]+) "
                     r"\| ([\d.]+) \| [\d.]+ \| ([\d.]+) \|$")
    for line in comparison_md.read_text().splitlines():
        m = pat.match(line)
        if m:
            out[m.group(1)] = Unloaded(m.group(1), float(m.group(4)), float(m.group(5)),
                                       float(m.group(6)))
    return out


def prefill_s(cost: StepCost, n: int, chunk: int = 512) -> float:
    """A lone prompt of n tokens, chunked, on an idle engine."""
    return sum(cost.step_s([(k, min(chunk, n - k))]) for k in range(0, n, chunk))


def calibrate(unloaded: dict[str, Unloaded], cost: StepCost,
              transfer_s_per_token: float = TRANSFER_S_PER_TOKEN,
              prefill_factor: float = 1.0, remote_s: float | None = None) -> Overheads:
    """Time outside the modelled steps, from one-at-a-time requests. A chat prompt (local,
    ~100 tokens) and a long-batch one (remote, ~1,100) decode alone: their TPOTs minus a
    one-row decode step at their contexts give the per-step streaming overhead and the cost
    per context token the profile misses (two equations, two unknowns; neither below 0).
    The chat prompt's TTFT minus its prefill gives the local path's fixed cost, the long
    one's minus prefill (the prefill worker's, `prefill_factor` x the profile's) and
    transfer the remote path's, unless `remote_s` is measured (`idle_probes`): a
    difference of two seconds-long times is mostly their noise."""
    chat, batch = unloaded["chat"], unloaded["long-batch"]
    ctx = int(chat.prompt_tokens) + 24
    n = int(batch.prompt_tokens)
    bctx = n + 12  # mid-stream: its outputs are ~24 tokens
    chat_extra = chat.tpot_ms / 1e3 - cost.step_s([(ctx, 1)])
    batch_extra = batch.tpot_ms / 1e3 - cost.step_s([(bctx, 1)])
    per_ctx = max(0.0, (batch_extra - chat_extra) / (bctx - ctx)) if bctx > ctx else 0.0
    step = max(0.0, chat_extra - per_ctx * ctx)
    local = max(0.0, chat.ttft_ms / 1e3 - prefill_s(cost, int(chat.prompt_tokens)) - step)
    chunks = -(-n // 512)
    remote = max(0.0, batch.ttft_ms / 1e3 - prefill_factor * prefill_s(cost, n) - chunks * step
                 - n * transfer_s_per_token) if remote_s is None else remote_s
    return Overheads(local_s=local, remote_s=remote, step_s=step,
                     transfer_s_per_token=transfer_s_per_token, context_s_per_token=per_ctx,
                     prefill_factor=prefill_factor)


def record_engine(root: Path) -> dict[str, Any]:
    """The engines' flags in a bench.goodput / bench.sim.real record's setup, as SimConfig
    fields: the step targets (before a flag existed there was none: 0, the token budget
    alone; the interactive one since 60412ad), the KV pool (`kv_cache_mb`; bench.goodput's
    default 512 where a record does not say) and the token budget and chunk; the router's
    --remote-overhead-window; and the workers' --threads (`record_threads`) and whether the
    prefill worker adapted them (`record_adapts`)."""
    path = root / "setup.json"
    whole = records.read_json(path) if records.exists(path) else {}
    setup = whole.get("setup", {})
    return {"remote_overhead_window": _overhead_window(setup.get("router_extra")),
            "prefill_threads": record_threads(whole),
            "prefill_adapt": record_adapts(whole),
            "step_target_ms": float(setup.get("step_target_ms", 0.0)),
            "interactive_step_target_ms": float(setup.get("interactive_step_target_ms", 0.0)),
            "num_blocks": int(float(setup.get("kv_cache_mb", 512))) * 2**20 // BLOCK_BYTES,
            "max_num_batched_tokens": int(setup.get("max_num_batched_tokens", 2048)),
            "max_prefill_chunk": int(setup.get("max_prefill_chunk", 512))}


def _layouts(setup: dict[str, Any]) -> list[str]:
    """A record's layouts (bench.goodput / bench.sim.real setup.json): its own, and each
    system's."""
    return [setup.get("layout") or "", *(s.get("layout") or ""
                                         for s in (setup.get("systems") or {}).values())]


def record_threads(setup: dict[str, Any]) -> int:
    """The workers' --threads in a record's layout ("workers `--threads 1 ...`"), 0 where
    none is given (`pdserve cluster up`'s placement chooses: bench.sim.real's 1P2D from
    stop 74 on)."""
    for layout in _layouts(setup):
        m = re.search(r"workers `[^`]*--threads[ =](\d+)", layout)
        if m:
            return int(m.group(1))
    return 0


def record_adapts(setup: dict[str, Any]) -> bool:
    """Whether a record's unpinned prefill worker adapted its threads to the CPUs left free
    (bench.sim.real's layout names `pdserve cluster up`'s prefill flags from stop 75 on;
    before, it ran all of them)."""
    return any("--adapt-threads" in layout for layout in _layouts(setup))


def _overhead_window(router_extra: str | None) -> int:
    """The router's --remote-overhead-window in a record's `router_extra` (the str of a
    tuple of flags); a record without the field was made before the router learned its
    remote overhead (router.calibration): 0."""
    if router_extra is None:
        return 0
    flags = [str(f) for f in ast.literal_eval(router_extra)]
    window = RouterConfig().remote_overhead_window
    for i, flag in enumerate(flags):
        name, eq, value = flag.partition("=")
        if name == "--remote-overhead-window":
            window = int(value if eq else flags[i + 1])
    return window


@dataclass(frozen=True)
class HostModel:
    """How the simulator shares a 2-core layout's cores (`SimConfig`): `prefill_threads`,
    cluster-up's unpinned prefill worker's threads (0: the record's); `free_window_s` and
    `barrier`, how an adapting one sizes its steps and how a step on several threads
    advances (0 and False: the simulator before stop 77)."""

    prefill_threads: int = 0
    free_window_s: float = WINDOW_S
    barrier: bool = True


def layout_config(layout: str, engine: dict[str, Any], policy: str, overheads: Overheads,
                  seed: int, corun: dict[tuple[str, str], float],
                  model: HostModel | None = None) -> SimConfig:
    """The simulator of a real record's 2-core layout (1p1d: bench.goodput's, 1p2d: `pdserve
    cluster up`'s), with the record's engine flags (`record_engine`) and `model`'s way of
    sharing the cores."""
    m = model or HostModel()
    return SimConfig(n_decode=2 if layout == "1p2d" else 1, n_prefill=1,
                     **{**engine, "prefill_threads": m.prefill_threads
                        or engine.get("prefill_threads", 0)},
                     policy=policy, router=GOODPUT_ROUTER,  # type: ignore[arg-type]
                     sharing="cluster-up" if layout == "1p2d" else "1p1d",
                     overheads=overheads, seed=seed, corun=corun,
                     free_window_s=m.free_window_s, barrier=m.barrier)


def calibrate_streaming(root: Path, overheads: Overheads, cost: StepCost, seed: int
                        ) -> tuple[Overheads, list[dict[str, Any]]]:
    """Per-streamed-token cost from closed-loop chat runs at a few concurrencies
    (bench.sim.real streaming): replay each run's requests in the 1P1D simulator without it,
    and fit the extra TPOT as `token_s` x concurrency (least squares through 0)."""
    points = []
    for path in records.glob(root, "concurrency_*.json"):
        reqs, rec = trace_from_record(path, seed)
        c = int(rec["config"]["concurrency"])
        sim = simulate(SimConfig(policy="threshold", router=GOODPUT_ROUTER, sharing="1p1d",
                                 overheads=overheads, seed=seed, **record_engine(root)),
                       reqs, MIXED_SLO, cost)
        meas = rec["summary"]["overall"]["tpot_ms"]["p50"]
        pred = sim.summary.overall.tpot_ms.p50 if sim.summary.overall.tpot_ms else 0.0
        points.append({"concurrency": c, "tpot_p50_measured_ms": round(meas, 1),
                       "tpot_p50_sim_without_ms": round(pred, 1)})
    num = sum(p["concurrency"] * (p["tpot_p50_measured_ms"] - p["tpot_p50_sim_without_ms"])
              for p in points)
    den = sum(p["concurrency"] ** 2 for p in points)
    token_s = max(0.0, num / den / 1e3) if den else 0.0
    return replace(overheads, token_s=token_s), points


CORUN_SHARES = tuple(i / 10 for i in range(11))


def calibrate_corun(root: Path, overheads: Overheads, cost: StepCost, seed: int,
                    corun: dict[tuple[str, str], float], model: HostModel | None = None
                    ) -> tuple[Overheads, list[dict[str, Any]]]:
    """The share of the co-run table's decode slowdown that `pdserve cluster up`'s 1P2D
    shows (`Overheads.corun_share`), from closed-loop chat streams on it (bench.sim.real
    streaming --layout 1p2d: every prompt local, both decode workers streaming, the prefill
    worker idle): replay each concurrency's run in the 1P2D simulator at each share of
    CORUN_SHARES and keep the one whose TPOT p50s are nearest the measured (least mean
    squared log ratio). `overheads` carries the per-token cost already fitted on 1P1D."""
    runs = [trace_from_record(path, seed) for path in records.glob(root, "concurrency_*.json")]
    engine = record_engine(root)

    def judge(o: Overheads) -> tuple[list[float], dict[str, Any]]:
        by_c = {}
        for reqs, rec in runs:
            sim = simulate(layout_config("1p2d", engine, "threshold", o, seed, corun, model),
                           reqs, MIXED_SLO, cost)
            pred = sim.summary.overall.tpot_ms.p50 if sim.summary.overall.tpot_ms else 0.0
            by_c[int(rec["config"]["concurrency"])] = (
                rec["summary"]["overall"]["tpot_ms"]["p50"], pred)
        return [p / m for m, p in by_c.values()], {
            "corun_share": o.corun_share,
            "tpot_p50_measured_vs_sim_ms": {
                c: [round(m, 1), round(p, 1)] for c, (m, p) in sorted(by_c.items())}}

    return _least_log_error((replace(overheads, corun_share=s) for s in CORUN_SHARES), judge)


def _least_log_error(grid: Iterable[Overheads],
                     judge: Callable[[Overheads], tuple[list[float], dict[str, Any]]]
                     ) -> tuple[Overheads, list[dict[str, Any]]]:
    """Of `grid`, the overheads whose ratios of simulated to measured (`judge`'s, with a
    record of the point) have the least mean squared log (the first of equals), and every
    point's record with that error (`mean_squared_log_ratio`): the calibrations' grid fit."""
    points: list[dict[str, Any]] = []
    best: tuple[float, Overheads | None] = (float("inf"), None)
    for o in grid:
        ratios, point = judge(o)
        err = statistics.fmean(math.log(max(x, 1e-6)) ** 2 for x in ratios)
        points.append({**point, "mean_squared_log_ratio": round(err, 4)})
        if err < best[0] - 1e-12:
            best = (err, o)
    assert best[1] is not None, "an empty grid"
    return best[1], points


def idle_probes(root: Path, cost: StepCost) -> tuple[float, float, float, list[dict[str, Any]]]:
    """From bench.sim.real prefill's idle pass (long prompts one at a time, nothing else
    running), medians: the KV transfer's time per prompt token (the part after the prompt's
    last chunk: the rest is sent while it computes), the prefill worker's compute over the
    profile's price of a lone prompt, and the remote path's fixed cost (the client's TTFT
    less the compute and the transfer: HTTP, routing, allocation, dispatch, hand-off)."""
    rec = records.read_json(root / "probes_c0.json")
    rows = [r for r in rec["requests"] if r.get("route") == "remote"
            and "prefill_compute_ms" in (r.get("server_timings_ms") or {})]
    if not rows:
        raise SystemExit(f"{root}: no remote probe with server timings")
    profile = [prefill_s(cost, r["prompt_tokens"]) for r in rows]
    transfer = statistics.median(r["server_timings_ms"]["kv_transfer_ms"] / 1e3
                                 / r["prompt_tokens"] for r in rows)
    factor = statistics.median(r["server_timings_ms"]["prefill_compute_ms"] / 1e3 / lone
                               for r, lone in zip(rows, profile, strict=True))
    fixed = statistics.median(r["ttft_s"] - (r["server_timings_ms"]["prefill_compute_ms"]
                                             + r["server_timings_ms"]["kv_transfer_ms"]) / 1e3
                              for r in rows)
    points = [{"prompt_tokens": r["prompt_tokens"],
               "prefill_compute_ms": round(r["server_timings_ms"]["prefill_compute_ms"], 1),
               "profile_ms": round(lone * 1e3, 1),
               "kv_transfer_ms": round(r["server_timings_ms"]["kv_transfer_ms"], 2)}
              for r, lone in zip(rows, profile, strict=True)]
    return transfer, factor, max(0.0, fixed), points


def probe_trace(root: Path, c: int, seed: int) -> tuple[list[SimRequest], list[str], list[float]]:
    """One pass of bench.sim.real prefill beside `c` streams, as it was sent: the streams'
    requests and the probes on one clock; returns the requests, the probes' ids and their
    measured TTFTs (s)."""
    setup = records.read_json(root / "setup.json")["runs"][str(c)]
    streams, _ = trace_from_record(root / f"streams_c{c}.json", seed)
    probes, rec = trace_from_record(root / f"probes_c{c}.json", seed + 1)
    shift = setup["probe_started_at"] - setup["streams_started_at"]
    probes = [replace(r, rid=f"probe-{r.rid}", arrival_s=r.arrival_s + shift) for r in probes]
    measured = {f"probe-r{r['index']}": r["ttft_s"] for r in rec["requests"]}
    return (sorted([*streams, *probes], key=lambda r: r.arrival_s), [r.rid for r in probes],
            [measured[r.rid] for r in probes])


PREFILL_WEIGHTS = (50.0, 100.0, 150.0, 200.0, 250.0, 335.0, 500.0, 700.0, 1024.0)
BESIDE_DECODE = (1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3)


def fit_prefill_sharing(root: Path, layout: str, overheads: Overheads, cost: StepCost,
                        seed: int, corun: dict[tuple[str, str], float] | None = None,
                        model: HostModel | None = None
                        ) -> tuple[Overheads, list[dict[str, Any]]]:
    """Replay the probes beside streams in the simulator of `layout` and pick the prefill
    side's sharing constants for which the probes' simulated TTFT is nearest the measured
    (median ratio): its slowdown while a decode worker computes (BESIDE_DECODE) and, on
    cluster-up's 1P2D where it runs unpinned at nice 5, the CPU weight it competes with
    (PREFILL_WEIGHTS; 1P1D pins it, so its weight is moot). `corun`: the engines' own
    slowdowns beside each other, which the validated runs are replayed with: the fitted
    slowdown is the cluster's on top of them (`Overheads.prefill_beside_decode`)."""
    setup = records.read_json(root / "setup.json")
    passes = [int(c) for c in setup["runs"] if int(c) > 0]
    traces = {c: probe_trace(root, c, seed) for c in passes}
    engine = record_engine(root)

    def ratios(o: Overheads) -> dict[int, list[float]]:
        out = {}
        for c, (reqs, probe_ids, measured) in traces.items():
            cfg = layout_config(layout, engine, "threshold", o, seed, corun or {}, model)
            sim = simulate(cfg, reqs, MIXED_SLO, cost)
            by_id = {r.rid: res for r, res in zip(reqs, sim.requests, strict=True)}
            out[c] = [(by_id[i].ttft_s or 0.0) / m for i, m in zip(probe_ids, measured,
                                                                   strict=True)]
        return out

    def judge(o: Overheads) -> tuple[list[float], dict[str, Any]]:
        r = ratios(o)
        xs = [x for v in r.values() for x in v]
        return xs, {"prefill_weight": o.prefill_weight,
                    "prefill_beside_decode": o.prefill_beside_decode,
                    "ttft_sim_over_measured_median": round(statistics.median(xs), 3),
                    "by_concurrency": {c: [round(x, 3) for x in v] for c, v in r.items()}}

    weights = PREFILL_WEIGHTS if layout == "1p2d" else (overheads.prefill_weight,)
    return _least_log_error((replace(overheads, prefill_weight=w, prefill_beside_decode=b)
                             for w, b in itertools.product(weights, BESIDE_DECODE)), judge)


# --------------------------------------------------------------------------- validation

# (record directory, system name in it, layout) for each real cluster and placement.
SYSTEMS = {
    "1p1d": (("disaggregated", "threshold"), ("disaggregated-cost", "cost")),
    "1p2d": (("1p2d", "threshold"), ("1p2d-cost", "cost")),
}
# A remote prefill's lease, by the router and decode workers that made a record. Whatever
# the rule, a cold prefill worker's queue is predicted at the prior rate (as routers from
# 1025729 on do; before, a cold worker's lease was --prefill-timeout).
LEASES = {
    "fixed": "--prefill-timeout (routers before 4c19bbe)",
    "stretched": "stretched to cover the prefill queue's prediction, ending at its first "
                 "deadline (4c19bbe to bc898d1)",
    "renewed": "stretched, then renewed by each part of the KV that lands (bc898d1 on)",
}


def _pcts(g: GroupSummary | None) -> dict[str, float | None]:
    def get(p: Percentiles | None, q: str) -> float | None:
        return None if p is None else round(getattr(p, q), 1)

    ttft, tpot = (None, None) if g is None else (g.ttft_ms, g.tpot_ms)
    return {"ttft_p50": get(ttft, "p50"), "ttft_p90": get(ttft, "p90"),
            "tpot_p50": get(tpot, "p50"), "tpot_p90": get(tpot, "p90")}


def metrics_of(summary: Any) -> dict[str, dict[str, float | None]]:
    """TTFT/TPOT p50/p90 (ms) overall and per latency class, from a loadgen RunSummary (the
    real run's is read back from JSON as a dict)."""
    if isinstance(summary, dict):
        def pc(d: dict[str, Any] | None) -> dict[str, float | None]:
            def get(k: str, q: str) -> float | None:
                v = d and d.get(k)
                return None if not v else round(v[q], 1)

            return {"ttft_p50": get("ttft_ms", "p50"), "ttft_p90": get("ttft_ms", "p90"),
                    "tpot_p50": get("tpot_ms", "p50"), "tpot_p90": get("tpot_ms", "p90")}

        return {"all": pc(summary["overall"]),
                **{c: pc(g) for c, g in summary["by_class"].items()}}
    return {"all": _pcts(summary.overall),
            **{c: _pcts(g) for c, g in summary.by_class.items()}}


def validate(reals: Sequence[tuple[Path, str]], cost: StepCost, seed: int,
             streaming: Path | None = None,
             corun: dict[tuple[str, str], float] | None = None,
             probes: dict[str, Path] | None = None, lease: str = "renewed",
             shared_local: bool = False, model: HostModel | None = None,
             streaming_1p2d: Path | None = None) -> dict[str, Any]:
    """Each real run's requests replayed in the simulator of its layout; `corun`: the
    two-busy-cores slowdown table (bench.sim.workers.load_corun; {}: none);
    `streaming_1p2d`: chat streams on 1P2D that calibrate the share of that table the
    running cluster shows (`calibrate_corun`; None: all of it); `probes`: per
    layout, a bench.sim.real prefill output that calibrates the prefill side; `lease`: the
    records' router and decode workers' rule for a remote prefill's lease (`LEASES`);
    `shared_local`: every layout's local path gets the least fixed cost any of the records
    measured (the same HTTP, router and gRPC code on each layout; a record's few unloaded
    requests scatter: stop 71's 1P2D record put it at 43 ms, its 1P1D record at 7)."""
    rows = []
    calib: dict[str, Any] = {}
    fitted: list[tuple[Path, str, Overheads]] = []
    idles = {layout: idle_probes(path, cost) for layout, path in (probes or {}).items()}
    # 1P1D's prefill worker computes on one pinned core, 1P2D's on every core: how much
    # faster the second is idle (`Overheads.prefill_speedup`).
    speedup = (idles["1p1d"][1] / idles["1p2d"][1]
               if idles.keys() >= {"1p1d", "1p2d"} else 0.0)
    for root, layout in reals:
        systems = SYSTEMS[layout]
        # Interference from other processes only adds time: per class, the fastest of the
        # record's unloaded measurements (both placements measure the same idle requests).
        tables = [t for name, _ in systems if (t := read_unloaded(root / "comparison.md", name))]
        if not tables:
            raise SystemExit(f"{root}: no unloaded table for {[n for n, _ in systems]}")
        unloaded = {k: Unloaded(k, tables[0][k].prompt_tokens,
                                min(t[k].ttft_ms for t in tables if k in t),
                                min(t[k].tpot_ms for t in tables if k in t))
                    for k in tables[0]}
        probe = (probes or {}).get(layout)
        idle: list[dict[str, Any]] = []
        if probe is None:
            overheads = calibrate(unloaded, cost)
        else:
            transfer, factor, fixed, idle = idles[layout]
            overheads = calibrate(unloaded, cost, transfer, factor, fixed)
            if layout == "1p2d":
                overheads = replace(overheads, prefill_speedup=speedup)
        points: list[dict[str, Any]] = []
        if streaming is not None:
            overheads, points = calibrate_streaming(streaming, overheads, cost, seed)
        shares: list[dict[str, Any]] = []
        if layout == "1p2d" and streaming_1p2d is not None and corun:
            overheads, shares = calibrate_corun(streaming_1p2d, overheads, cost, seed, corun,
                                                model)
        weights: list[dict[str, Any]] = []
        if probe is not None:
            overheads, weights = fit_prefill_sharing(probe, layout, overheads, cost, seed,
                                                     corun, model)
        calib[f"{layout} {root.name}"] = {"unloaded": {k: asdict(v) for k, v in unloaded.items()},
                         "streaming": points, "corun_share": shares,
                         "prefill_idle": idle,
                         "prefill_beside_streams": weights, "overheads": asdict(overheads)}
        fitted.append((root, layout, overheads))
    if shared_local:
        local_s = min(o.local_s for _, _, o in fitted)
        fitted = [(root, layout, replace(o, local_s=local_s)) for root, layout, o in fitted]
        for root, layout, o in fitted:
            calib[f"{layout} {root.name}"]["overheads"] = asdict(o)
    for root, layout, overheads in fitted:
        systems = SYSTEMS[layout]
        engine = record_engine(root)
        for system, policy in systems:
            for path in records.glob(root / system, "rate_*.json"):
                reqs, rec = trace_from_record(path, seed)
                cfg = layout_config(layout, engine, policy, overheads, seed, corun or {},
                                    model)
                if lease == "fixed":
                    cfg = replace(cfg, max_remote_lease_s=cfg.remote_lease_s)
                cfg = replace(cfg, lease_renews=lease == "renewed")
                slo = SLO(**{**rec["config"]["slo"],
                             "per_class": tuple(map(tuple, rec["config"]["slo"]["per_class"]))})
                sim = simulate(cfg, reqs, slo, cost)
                measured, predicted = metrics_of(rec["summary"]), metrics_of(sim.summary)
                real_routes: dict[str, int] = {}
                for r in rec["requests"]:
                    real_routes[r.get("route") or "?"] = real_routes.get(r.get("route") or "?",
                                                                         0) + 1
                err = {g: {k: None if not m.get(k) or predicted.get(g, {}).get(k) is None
                           else round(predicted[g][k] / m[k] - 1, 3)  # type: ignore[operator]
                           for k in m} for g, m in measured.items()}
                requests = [_request_row(r, p) for r, p in zip(rec["requests"], sim.requests,
                                                                    strict=True)]
                rows.append({
                    "record": root.name, "layout": layout, "policy": policy,
                    "rate": rec["config"]["rate"],
                    "n": len(reqs), "measured": measured, "predicted": predicted,
                    "relative_error": err,
                    "attainment": {"measured": rec["summary"]["overall"]["attainment"]["both"],
                                   "predicted": sim.summary.overall.attainment.both},
                    "routes": {"measured": real_routes, "predicted": sim.routes},
                    "requests": requests})
    return {"calibration": calib, "rows": rows, "within_15pct": within(rows, 0.15)}


def _request_row(real: dict[str, Any], sim: RequestResult) -> dict[str, Any]:
    """One request measured and simulated: [measured, simulated] per metric (ms), so a
    cell's error can be traced to the requests and the stage it comes from."""
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 1)

    def stalls(itl: Sequence[float]) -> int:
        return sum(1 for x in itl if x > STALL_S)

    timings = real.get("server_timings_ms") or {}
    return {"index": real["index"], "class": real["latency_class"],
            "prompt_tokens": real["prompt_tokens"], "output_tokens": real["output_tokens"],
            "start_s": round(real["start_s"], 3), "route": [real.get("route"), sim.route],
            "ttft_ms": [ms(real["ttft_s"]), ms(sim.ttft_s)],
            "tpot_ms": [ms(real.get("tpot_s")), ms(sim.tpot_s)],
            "prefill_compute_ms": timings.get("prefill_compute_ms"),
            f"gaps_over_{int(STALL_S * 1e3)}ms": [stalls(real.get("itl_s") or ()),
                                                  stalls(sim.itl_s)]}


def within(rows: Sequence[dict[str, Any]], tol: float) -> dict[str, str]:
    """Per class and metric: how many of the compared cells are within `tol`."""
    hits: dict[str, list[bool]] = {}
    for r in rows:
        for g, errs in r["relative_error"].items():
            for k, e in errs.items():
                if e is not None:
                    hits.setdefault(f"{g} {k}", []).append(abs(e) <= tol)
    return {k: f"{sum(v)}/{len(v)}" for k, v in sorted(hits.items())}


def validation_table(v: dict[str, Any]) -> str:
    lines = ["| record | policy | rate | class | TTFT p50 meas / sim (err) | TTFT p90 | "
             "TPOT p50 | TPOT p90 |", "|---|---|---|---|---|---|---|---|"]
    for r in v["rows"]:
        for g in r["measured"]:
            cells = []
            for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"):
                m, p = r["measured"][g].get(k), r["predicted"].get(g, {}).get(k)
                e = r["relative_error"][g].get(k)
                cells.append("n/a" if m is None or p is None else
                             f"{m:.0f} / {p:.0f} ({e:+.0%})")
            lines.append(f"| {r['record']} | {r['policy']} | {r['rate']:g} | {g} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- policy comparison


# compare's name for cost placement without the router's learned remote overhead
# (router.calibration)
COST_UNCORRECTED = "cost-uncorrected"


def compare(workers: Sequence[int], policies: Sequence[str], workloads: Sequence[str],
            loads: Sequence[float], n_per_worker: int, cost: StepCost, seed: int,
            overheads: Overheads) -> list[dict[str, Any]]:
    """Each (workload, N decode workers + N/4 prefill, per-worker rate, policy) once, on a
    machine each. The rate is `load` requests/s per decode worker; requests:
    `n_per_worker` x N (at least 200)."""
    rows = []
    for workload in workloads:
        for n in workers:
            for load in loads:
                rate = load * n
                count = max(200, n_per_worker * n)
                reqs = (trace_mixed(count, rate, seed) if workload == "mixed" else
                        trace_chat(count, rate, seed, open_conversations=8 * n))
                for policy in policies:
                    uncorrected = policy == COST_UNCORRECTED
                    cfg = SimConfig(n_decode=n, n_prefill=max(1, n // 4),
                                    policy="cost" if uncorrected else policy,
                                    router=GOODPUT_ROUTER, overheads=overheads, seed=seed,
                                    **({"remote_overhead_window": 0} if uncorrected else {}))
                    t = time.perf_counter()
                    sim = simulate(cfg, reqs, MIXED_SLO, cost)
                    row = summary_row(sim)
                    row.update(policy=policy, workload=workload, decode_workers=n,
                               prefill_workers=cfg.n_prefill, rate_per_worker=load,
                               rate=rate, requests=count,
                               wall_s=round(time.perf_counter() - t, 1))
                    rows.append(row)
                    print(f"{workload:6} N={n:<4} load={load:<5g} {policy:13} "
                          f"att={row['attainment']:.2f} goodput={row['goodput_rps']:.2f}/s "
                          f"hit={row['prefix_hit_rate']:.2f} "
                          f"prefill-hit={row['prefill_hit_rate']:.2f} ({row['wall_s']} s)",
                          file=sys.stderr, flush=True)
    return rows


def summary_row(sim: SimResult) -> dict[str, Any]:
    s = sim.summary
    return {"policy": sim.config.policy, "attainment": round(s.overall.attainment.both, 3),
            "goodput_rps": round(sim.goodput_rps, 3),
            "prefix_hit_rate": round(sim.prefix_hit_rate, 3),
            "prefill_hit_rate": round(sim.prefill_hit_rate, 3), "routes": sim.routes,
            "errors": s.overall.num_errors, "metrics": metrics_of(s),
            "attainment_by_class": {c: round(g.attainment.both, 3)
                                    for c, g in s.by_class.items()}}


def compare_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| workload | N decode | req/s per worker | policy | SLO att. | goodput req/s | "
             "prefix hit | TTFT p50 / p90 ms | TPOT p50 / p90 ms | remote share |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["metrics"]["all"]
        n = sum(r["routes"].values()) or 1
        lines.append(
            f"| {r['workload']} | {r['decode_workers']} | {r['rate_per_worker']:g} | "
            f"{r['policy']} | {r['attainment']:.0%} | {r['goodput_rps']:.2f} | "
            f"{r['prefix_hit_rate']:.0%} | {m['ttft_p50'] or 0:.0f} / {m['ttft_p90'] or 0:.0f} "
            f"| {m['tpot_p50'] or 0:.0f} / {m['tpot_p90'] or 0:.0f} | "
            f"{r['routes'].get('remote', 0) / n:.0%} |")
    return "\n".join(lines)


def goodput_table(rows: Sequence[dict[str, Any]], target: float = 0.9) -> tuple[
        str, list[dict[str, Any]]]:
    """Per (workload, N, policy): bench.loadgen's goodput over the swept rates (the highest
    rate with >= `target` of requests meeting both SLOs, interpolated to the crossing)."""
    groups: dict[tuple[str, int], dict[str, list[tuple[float, float]]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["decode_workers"]), {}).setdefault(
            r["policy"], []).append((r["rate"], r["attainment"]))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lines = ["| workload | N decode (+ prefill) | " + " | ".join(policies) + " | best |",
             "|---|---|" + "---|" * (len(policies) + 1)]
    out = []
    for (workload, n), by_policy in groups.items():
        cells, best = [], ("", -1.0)
        for p in policies:
            g = goodput(by_policy.get(p, []), target)
            value = g.interpolated or 0.0
            out.append({"workload": workload, "decode_workers": n, "policy": p,
                        "goodput_rps": g.rate, "interpolated_rps": g.interpolated,
                        "bounded": g.bounded})
            mark = "" if g.bounded else "+"  # no swept rate above it failed
            cells.append("none" if g.rate is None else f"{value:.1f}{mark}")
            if value > best[1]:
                best = (p, value)
        lines.append(f"| {workload} | {n} (+{max(1, n // 4)}) | " + " | ".join(cells)
                     + f" | {best[0]} |")
    return "\n".join(lines), out


def cost_vs_threshold(reals: Sequence[tuple[Path, str]], validation: dict[str, Any] | None,
                      workers: Sequence[int], loads: Sequence[float], n_per_worker: int,
                      cost: StepCost, seed: int, overheads: Overheads) -> dict[str, Any]:
    """Goodput (bench.loadgen's: highest swept rate with >= 90 % meeting the mixed SLOs) of
    threshold and cost placement: measured on the real clusters (their records), simulated
    on the same traces (a validate output's rows), and simulated at N decode workers."""
    out: list[dict[str, Any]] = []
    for root, layout in reals:
        for system, policy in SYSTEMS[layout]:
            g = records.read_json(root / system / "summary.json")["goodput"]
            out.append({"where": f"real {root.name}", "policy": policy, "goodput_rps": g["rate"],
                        "interpolated_rps": g["interpolated"], "bounded": g["bounded"]})
            if validation is not None:
                pts = [(r["rate"], r["attainment"]["predicted"]) for r in validation["rows"]
                       if r["record"] == root.name and r["policy"] == policy]
                if pts:
                    sg = goodput(pts, 0.9)
                    out.append({"where": f"sim {root.name} (same traces)", "policy": policy,
                                "goodput_rps": sg.rate, "interpolated_rps": sg.interpolated,
                                "bounded": sg.bounded})
    rows = compare(workers, ["threshold", "cost"], ["mixed"], loads, n_per_worker, cost, seed,
                   overheads)
    _, goodputs = goodput_table(rows)
    for g in goodputs:
        out.append({"where": f"sim {g['decode_workers']}D + {max(1, g['decode_workers'] // 4)}P",
                    "policy": g["policy"], "goodput_rps": g["goodput_rps"],
                    "interpolated_rps": g["interpolated_rps"], "bounded": g["bounded"]})
    return {"goodput": out, "rows": rows}


def side_by_side_table(res: dict[str, Any]) -> str:
    cells: dict[str, dict[str, str]] = {}
    for g in res["goodput"]:
        v = g["interpolated_rps"]
        cells.setdefault(g["where"], {})[g["policy"]] = "none" if v is None else (
            f"{v:.2f}" + ("" if g["bounded"] else "+"))
    lines = ["| where | threshold goodput req/s | cost goodput req/s |", "|---|---|---|"]
    lines += [f"| {w} | {c.get('threshold', '')} | {c.get('cost', '')} |"
              for w, c in cells.items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def provenance() -> dict[str, Any]:
    """The commit the record is made at, whether the simulator's or the router's placement
    code differed from it, and how busy the machine was (the records name them)."""
    root = Path(__file__).resolve().parents[1]

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "dirty_paths": git("status", "--porcelain", "--", "bench/sim", "bench/cluster_sim.py",
                               "router").splitlines(),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg()}


def calibrated(validation: dict[str, Any]) -> Overheads:
    """The first 1P1D calibration of a validate output: the software path of one worker
    pair, which the fleets of `compare` reuse (each worker on a machine of its own)."""
    key = next(k for k in validation["calibration"] if k.startswith("1p1d"))
    return Overheads(**validation["calibration"][key]["overheads"])


def _real(text: str) -> tuple[Path, str]:
    path, _, layout = text.rpartition(":")
    if layout not in SYSTEMS:
        raise argparse.ArgumentTypeError(f"expected DIR:LAYOUT with LAYOUT in {list(SYSTEMS)}")
    return Path(path), layout


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster_sim",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, default=None, help="bench.engine_profile JSON")
    ap.add_argument("--seed", type=int, default=0)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="predicted vs measured on real runs' traces")
    v.add_argument("--real", type=_real, action="append", required=True,
                   help="DIR:LAYOUT, a bench.goodput / bench.sim.real output (1p1d or 1p2d)")
    v.add_argument("--streaming", type=Path, default=None,
                   help="bench.sim.real streaming output: fit the per-token overhead")
    v.add_argument("--streaming-1p2d", type=Path, default=None,
                   help="bench.sim.real streaming --layout 1p2d output: fit the share of "
                        "--corun's decode slowdown the running 1P2D cluster shows "
                        "(default: all of it)")
    v.add_argument("--corun", type=Path, default=None,
                   help="bench.engine_profile --corun output: slow steps while both cores "
                        "compute (default: no such slowdown)")
    v.add_argument("--prefill-probe", type=_real, action="append", default=[],
                   help="DIR:LAYOUT, a bench.sim.real prefill output: the prefill worker's "
                        "speed, KV transfer, slowdown beside a computing decode worker and "
                        "CPU weight on that layout")
    v.add_argument("--lease", choices=LEASES, default="renewed",
                   help="the records' rule for a remote prefill's lease: " + "; ".join(
                       f"{k}: {v}" for k, v in LEASES.items()))
    v.add_argument("--fixed-lease", dest="lease", action="store_const", const="fixed",
                   help="the same as --lease fixed")
    v.add_argument("--shared-local", action="store_true",
                   help="every layout's local path at the least fixed cost any record's "
                        "unloaded requests measured (the same code on each layout)")
    v.add_argument("--prefill-threads", type=int, default=0,
                   help="threads of cluster-up's unpinned prefill worker, which share the "
                        "cores as Linux's scheduler does (default 0: the record's --threads, "
                        "else one per core, as `pdserve cluster up` runs it)")
    v.add_argument("--free-window-s", type=float, default=WINDOW_S,
                   help="an adapting prefill worker sizes each step by the CPU the others "
                        f"took over about this many seconds (default {WINDOW_S}, the "
                        "engine's); 0: by the cores idle at each instant, resized mid-step "
                        "(the simulator before stop 77)")
    v.add_argument("--no-barrier", action="store_true",
                   help="a step on several threads advances by the sum of its threads' CPU "
                        "shares, not as one thread at the least share where one shares a "
                        "core (the simulator before stop 77)")
    v.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare", help="policies at scale")
    c.add_argument("--workers", default="8,16,64,256")
    c.add_argument("--policies", default=",".join(POLICIES),
                   help=f"some of {', '.join((*POLICIES, COST_UNCORRECTED))} ({COST_UNCORRECTED}: "
                        "cost without the router's learned remote overhead)")
    c.add_argument("--workloads", default="mixed,chat")
    c.add_argument("--loads", default="0.3,0.5,0.7,0.9", help="req/s per decode worker")
    c.add_argument("--requests-per-worker", type=int, default=25)
    c.add_argument("--calibration", type=Path, default=None,
                   help="a validate output: use its 1p1d overheads (default: none)")
    c.add_argument("--remote-s", type=float, default=None, metavar="SECONDS",
                   help="the remote path's fixed cost outside the engines (dispatch, "
                        "allocation, hand-off; default: the calibration's or 0): a "
                        "deployment whose network the cost model's 20 ms does not know")
    c.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("cost-vs-threshold", help="goodput side by side: real and simulated")
    b.add_argument("--real", type=_real, action="append", required=True)
    b.add_argument("--validation", type=Path, default=None, help="a validate output")
    b.add_argument("--workers", default="16,64")
    b.add_argument("--loads", default="0.1,0.15,0.2,0.25,0.3,0.4")
    b.add_argument("--requests-per-worker", type=int, default=25)
    b.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    cost = StepCost.load(args.profile) if args.profile else StepCost.load()
    record: dict[str, Any] = {"command": "python -m bench.cluster_sim " + " ".join(
        sys.argv[1:] if argv is None else argv), **provenance()}
    if args.cmd == "validate":
        model = HostModel(args.prefill_threads, args.free_window_s, not args.no_barrier)
        record.update(validate(args.real, cost, args.seed, args.streaming,
                               load_corun(args.corun) if args.corun else {},
                               {layout: path for path, layout in args.prefill_probe},
                               lease=args.lease, shared_local=args.shared_local,
                               model=model, streaming_1p2d=args.streaming_1p2d))
        record["corun"] = str(args.corun) if args.corun else None
        record["prefill_threads"] = args.prefill_threads
        record["host_model"] = asdict(model)
        print(validation_table(record))
        print(json.dumps(record["within_15pct"], indent=1))
    elif args.cmd == "cost-vs-threshold":
        val = records.read_json(args.validation) if args.validation else None
        overheads = calibrated(val) if val else Overheads(
            transfer_s_per_token=TRANSFER_S_PER_TOKEN)
        record.update(overheads=asdict(overheads), **cost_vs_threshold(
            args.real, val, [int(x) for x in args.workers.split(",")],
            [float(x) for x in args.loads.split(",")], args.requests_per_worker, cost,
            args.seed, overheads))
        print(side_by_side_table(record))
    else:
        overheads = Overheads(transfer_s_per_token=TRANSFER_S_PER_TOKEN)
        if args.calibration:
            overheads = calibrated(records.read_json(args.calibration))
        if args.remote_s is not None:
            overheads = replace(overheads, remote_s=args.remote_s)
        policies = [p for p in args.policies.split(",") if p]
        if set(policies) - {*POLICIES, COST_UNCORRECTED}:
            ap.error(f"--policies: some of {', '.join((*POLICIES, COST_UNCORRECTED))}")
        rows = compare([int(x) for x in args.workers.split(",")], cast(list[Policy], policies),
                       args.workloads.split(","), [float(x) for x in args.loads.split(",")],
                       args.requests_per_worker, cost, args.seed, overheads)
        table, goodputs = goodput_table(rows)
        record.update(overheads=asdict(overheads), rows=rows, goodput=goodputs)
        print(compare_table(rows))
        print()
        print(table)
    record["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
