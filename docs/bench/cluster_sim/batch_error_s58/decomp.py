"""Each batch request's TPOT three ways: measured (real run), 'model' = the simulator's step
model pricing the request's real step composition (the steps rebuilt from the real token
times on its decode worker, common.worker_steps, each priced with common.price, summed over
its inter-token intervals), and simulated (validation_spr_704c56d per-request rows).
'net' = measured TPOT with the last inter-token gap capped at the stream's median gap (the
remote stream's final event the router held; see last_gap.py). Prints per request, per
validation cell (p50 over the cell's batch requests) and per layout (median of per-request
errors)."""

import statistics as st

import numpy as np
from common import (
    EPS,
    VAL,
    load,
    overheads,
    pieces_of,
    policy_of,
    prefill_intervals,
    price,
    real_files,
    token_times,
    worker_steps,
    workers,
)

simrows = {}
for r in VAL["rows"]:
    for q in r["requests"]:
        simrows[(r["layout"], r["policy"], r["rate"], q["index"])] = q

rows = []
for layout in ("1p1d", "1p2d"):
    oh = overheads(layout)
    for f in real_files(layout):
        d = load(f)
        R = {r["index"]: r for r in d["requests"] if r["ok"]}
        pol, rate = policy_of(f), d["config"]["rate"]
        asg = workers(f, layout, R)
        busy = prefill_intervals(R)
        for w in (0, 1):
            steps, _ = worker_steps(R, asg, w)
            sp = [
                (t, price(oh, pieces_of(R, mem), len(mem)), any(k == 0 for i, k in mem))
                for t, mem in steps
            ]
            for i, r in R.items():
                if asg.get(i) != w or r["latency_class"] != "batch" or len(r["itl_s"]) < 1:
                    continue
                toks = token_times(r)
                pred = pre_ex = busy_ex = first_ex = 0.0
                for k in range(1, len(toks)):
                    a, b = toks[k - 1], toks[k]
                    ss = [s for s in sp if a + EPS / 2 < s[0] <= b + EPS / 2]
                    p = sum(s[1] for s in ss)
                    m = b - a
                    pred += p
                    if k == 1:
                        first_ex += m - p
                    elif any(s[2] for s in ss):
                        pre_ex += m - p
                    else:
                        pb = sum(max(0, min(b, e) - max(a, s0)) for s0, e in busy) / (b - a)
                        if pb > 0.5:
                            busy_ex += m - p
                n1 = r["output_tokens"] - 1
                it = list(r["itl_s"])
                it[-1] = min(it[-1], st.median(it))
                q = simrows[(layout, pol, rate, i)]
                rows.append(
                    dict(
                        layout=layout,
                        pol=pol,
                        rate=rate,
                        i=i,
                        meas=r["tpot_s"] * 1e3,
                        net=sum(it) / n1 * 1e3,
                        model=pred / n1 * 1e3,
                        sim=q["tpot_ms"][1],
                        first=first_ex / n1 * 1e3,
                        pre=pre_ex / n1 * 1e3,
                        busy=busy_ex / n1 * 1e3,
                        simroute=q["route"][1],
                    )
                )

print(
    "per request: layout policy rate index | TPOT ms: measured, net of held final event,"
    " model on the real steps, simulated | model/meas-1, sim/model-1, sim/meas-1 | excess"
    " over model, ms/token: first ITL, ITLs with a local prefill, ITLs with the prefill"
    " worker busy"
)
for x in rows:
    meas, net, model, sim = x["meas"], x["net"], x["model"], x["sim"]
    print(
        f"{x['layout']} {x['pol']:9s} {x['rate']:.2f} {x['i']:2d}"
        f" | {meas:6.1f} {net:6.1f} {model:6.1f} {sim:6.1f}"
        f" | {model / meas - 1:+.2f} {sim / model - 1:+.2f} {sim / meas - 1:+.2f}"
        f" | {x['first']:5.1f} {x['pre']:5.1f} {x['busy']:5.1f}"
        f" {'' if x['simroute'] == 'remote' else 'SIM-LOCAL'}"
    )

print()
print(
    "per cell: batch TPOT p50 ms: measured, net, model, sim"
    " | sim/meas-1, sim/net-1, sim/model-1 (record's own error)"
)
cnt = [0, 0, 0]
for r in VAL["rows"]:
    xs = [
        x
        for x in rows
        if x["layout"] == r["layout"] and x["pol"] == r["policy"] and x["rate"] == r["rate"]
    ]
    m, n, mo, s = (
        float(np.percentile([x[k] for x in xs], 50)) for k in ("meas", "net", "model", "sim")
    )
    e = [s / m - 1, s / n - 1, s / mo - 1]
    for k in range(3):
        cnt[k] += abs(e[k]) <= 0.15
    print(
        f"{r['layout']} {r['policy']:9s} {r['rate']:.2f} | {m:6.1f} {n:6.1f} {mo:6.1f} {s:6.1f}"
        f" | {e[0]:+.2f} {e[1]:+.2f} {e[2]:+.2f}"
        f"   (record: {r['relative_error']['batch']['tpot_p50']:+.2f})"
    )
print(
    "cells within 15 % (sim vs meas, vs net, vs model):",
    [int(c) for c in cnt],
    "of",
    len(VAL["rows"]),
)

print()
print("per layout, median over batch requests:")
for lay in ("1p1d", "1p2d"):
    xs = [x for x in rows if x["layout"] == lay]
    print(
        f"{lay} n={len(xs)}  sim/meas-1 {st.median([x['sim'] / x['meas'] - 1 for x in xs]):+.3f}"
        f"  sim/net-1 {st.median([x['sim'] / x['net'] - 1 for x in xs]):+.3f}"
        f"  model/net-1 {st.median([x['model'] / x['net'] - 1 for x in xs]):+.3f}"
        f"  model/meas-1 {st.median([x['model'] / x['meas'] - 1 for x in xs]):+.3f}"
        f"  sim/model-1 {st.median([x['sim'] / x['model'] - 1 for x in xs]):+.3f}"
    )
    xs = [x for x in xs if x["simroute"] == "remote"]
    print(
        f"{lay} simulated remote only n={len(xs)}: mean excess ms/token:"
        f" first ITL {st.mean([x['first'] for x in xs]):.1f},"
        f" local-prefill ITLs {st.mean([x['pre'] for x in xs]):.1f},"
        f" prefill-busy ITLs {st.mean([x['busy'] for x in xs]):.1f}"
    )
