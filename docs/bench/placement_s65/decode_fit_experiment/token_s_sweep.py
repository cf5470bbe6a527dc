"""Stop 65's experiment: the streams' and probes' simulated / measured medians beside the probes
for a per-streamed-token cost (`Overheads.token_s`) of 0-6 ms, on this session's calibration
(the output is token_s_sweep.txt; it ran with R = /tmp/s65/rec, this directory's first home).

    PYTHONPATH=. python docs/bench/placement_s65/decode_fit_experiment/token_s_sweep.py
"""

import json
import statistics
from dataclasses import replace
from pathlib import Path

import bench.cluster_sim as cs
from bench.sim.cluster import Overheads
from bench.sim.workers import StepCost

R = Path("docs/bench/placement_s65")
cost = StepCost.load(R / "engine_profile_zen3_a027c7f.json")
v = json.load(open(R / "validation_zen3_a027c7f.json"))
for key, probe, layout in (("1p2d real_1p2d_zen3", R / "prefill_probe_1p2d_zen3", "1p2d"),
                           ("1p1d real_1p1d_zen3", R / "prefill_probe_1p1d_zen3", "1p1d")):
    o = Overheads(**v["calibration"][key]["overheads"])
    engine = cs.record_engine(probe)
    setup = json.loads((probe / "setup.json").read_text())
    for ts in (0.0, 0.001, 0.002, 0.003, 0.004, 0.006):
        oo = replace(o, token_s=ts)
        out = {}
        for c in [int(c) for c in setup["runs"] if int(c) > 0]:
            reqs, pids, meas = cs.probe_trace(probe, c, 0)
            rec = json.loads((probe / f"streams_c{c}.json").read_text())
            m = {f"r{r['index']}": r["tpot_s"] for r in rec["requests"] if r.get("tpot_s")}
            sim = cs.simulate(cs.layout_config(layout, engine, "threshold", oo, 0, {}), reqs,
                              cs.MIXED_SLO, cost)
            by = {r.rid: res for r, res in zip(reqs, sim.requests, strict=True)}
            xs = [by[k].tpot_s / t for k, t in m.items() if by[k].tpot_s]
            ps = [(by[i].ttft_s or 0) / t for i, t in zip(pids, meas, strict=True)]
            out[c] = (round(statistics.median(xs), 3), round(statistics.median(ps), 3))
        print(layout, ts, out, flush=True)
