"""Batch requests' TPOT error (simulated/measured - 1, validation_spr_704c56d per-request rows)
against how their decode window differs between simulation and reality. A request's decode
window runs from its first token (start + TTFT) to its last (+ TPOT x (output - 1)), on each
side from the record's own numbers. Per batch request and side: 'streams alongside' = other
requests' decode windows overlapping it, as a fraction of its window, summed; 'local
prefills' = requests prefilled on the decode worker whose first token falls inside it;
'gaps' = the record's inter-token gaps over 150 ms.

1P1D has one decode worker, so these are the streams on the same worker. On 1P2D the
record does not say which decode worker the simulator chose, so both sides count the
whole cluster (both decode workers) there; see README.md."""

import numpy as np
from common import VAL


def windows(reqs, j):
    W = {}
    for q in reqs:
        if q["ttft_ms"][j] is None or q["tpot_ms"][j] is None:
            continue
        a = q["start_s"] + q["ttft_ms"][j] / 1e3
        b = a + q["tpot_ms"][j] / 1e3 * (q["output_tokens"] - 1)
        W[q["index"]] = (a, b, q["class"], q["route"][j])
    return W


def alongside(W, i):
    a, b = W[i][:2]
    streams = batch = 0.0
    lp = 0
    for k, (c, d, cl, ro) in W.items():
        if k == i:
            continue
        o = max(0.0, min(b, d) - max(a, c))
        streams += o
        batch += o if cl == "batch" else 0
        if ro == "local" and a < c <= b:
            lp += 1
    return streams / max(b - a, 1e-9), batch / max(b - a, 1e-9), lp


rows = []
for r in VAL["rows"]:
    Wm, Ws = windows(r["requests"], 0), windows(r["requests"], 1)
    for q in r["requests"]:
        if q["class"] != "batch" or q["index"] not in Wm or q["index"] not in Ws:
            continue
        i = q["index"]
        sm, bm, lm = alongside(Wm, i)
        ss, bs, ls = alongside(Ws, i)
        rows.append(
            dict(
                lay=r["layout"],
                pol=r["policy"],
                rate=r["rate"],
                i=i,
                out=q["output_tokens"],
                err=q["tpot_ms"][1] / q["tpot_ms"][0] - 1,
                sm=sm,
                ss=ss,
                dstreams=ss - sm,
                dbatch=bs - bm,
                lm=lm,
                ls=ls,
                dlp=ls - lm,
                gm=q["gaps_over_150ms"][0],
                gs=q["gaps_over_150ms"][1],
                dgaps=q["gaps_over_150ms"][1] - q["gaps_over_150ms"][0],
                ttft=q["ttft_ms"][1] / q["ttft_ms"][0] - 1,
                p2=r["layout"] == "1p2d",
                local=q["route"][1] != "remote",
            )
        )

print(
    "layout policy rate index out | TPOT err | streams alongside meas sim"
    " | local prefills meas sim | gaps>150ms meas sim | sim route"
)
for x in rows:
    print(
        f"{x['lay']} {x['pol']:9s} {x['rate']:.2f} {x['i']:2d} {x['out']:2d} | {x['err']:+.2f}"
        f" | {x['sm']:5.2f} {x['ss']:5.2f}"
        f" | {x['lm']} {x['ls']} | {x['gm']} {x['gs']} | {'local' if x['local'] else 'remote'}"
    )
print()
keys = ("dstreams", "dbatch", "dlp", "dgaps", "ttft", "out", "rate", "gm", "p2")
print(
    "correlation of TPOT error with: dstreams = sim - meas streams alongside, dbatch = same for"
    " batch streams, dlp = sim - meas local prefills, dgaps = sim - meas gaps > 150 ms,"
    " ttft = TTFT error, gm = measured gaps"
)
for sub, name in (
    (rows, "all"),
    ([x for x in rows if x["lay"] == "1p1d"], "1p1d"),
    ([x for x in rows if x["lay"] == "1p2d" and not x["local"]], "1p2d, simulated remote"),
):
    e = np.array([x["err"] for x in sub])
    cs = []
    for k in keys:
        v = np.array([float(x[k]) for x in sub])
        if np.std(v) > 0:
            cs.append(f"{k}:{np.corrcoef(e, v)[0, 1]:+.2f}")
    print(f"{name} (n={len(sub)}):", " ".join(cs))
print()
for lay in ("1p1d", "1p2d"):
    s = [x for x in rows if x["lay"] == lay and not x["local"]]
    a = [x["err"] for x in s if x["dstreams"] <= -0.5]
    b = [x["err"] for x in s if abs(x["dstreams"]) < 0.5]
    print(
        f"{lay} (simulated remote): sim has >= 0.5 fewer streams alongside:"
        f" n={len(a)} median TPOT err {np.median(a):+.2f}"
        f" | within 0.5: n={len(b)} median {np.median(b):+.2f}"
    )
