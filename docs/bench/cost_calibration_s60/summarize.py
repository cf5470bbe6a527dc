"""Summarize bench.goodput records of the disaggregated-cost system, one line per rate:
SLO attainment, and per latency class and route the request count, TTFT p50/p90 and TPOT
p50/p90 (ms); then the router's first-token-vs-prediction histograms and corrections as
/metrics showed them at the end of the sweep.

    python docs/bench/cost_calibration_s60/summarize.py DIR [DIR ...]
"""

import glob
import json
import sys


def quantile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def cell(rs: list[dict], label: str) -> str:
    t = [x["ttft_s"] * 1e3 for x in rs]
    tp = [x["tpot_s"] * 1e3 for x in rs if x.get("tpot_s")]
    return (f"{label} n={len(rs)} ttft {quantile(t, .5):.0f}/{quantile(t, .9):.0f} "
            f"tpot {quantile(tp, .5):.1f}/{quantile(tp, .9):.1f}")


for d in sys.argv[1:]:
    setup = json.load(open(f"{d}/setup.json"))
    print(f"== {d}")
    files = glob.glob(f"{d}/disaggregated-cost/rate_*.json")
    for f in sorted(files, key=lambda x: float(x.rsplit("_", 1)[-1][:-5])):
        r = json.load(open(f))
        att = r["summary"]["overall"]["attainment"]["both"]
        line = [f"rate {f.rsplit('_', 1)[-1][:-5]:>4} att={att:.3f}"]
        for cls in ("interactive", "batch"):
            ok = [x for x in r["requests"] if x["latency_class"] == cls and x["ok"]]
            for route in ("local", "remote"):
                rs = [x for x in ok if x.get("route") == route]
                if rs:
                    line.append(cell(rs, f"{cls[:5]}/{route[:3]}"))
            line.append(cell(ok, f"{cls[:5]}/all"))
        print("  " + " | ".join(line))
    for system in setup["systems"].values():
        for m in system.get("router_metrics", []):
            m = m.replace('model_name="SmolLM2-135M-Instruct",', "")
            if ("_count" in m or "correction" in m
                    or ("_bucket" in m and any(f'le="{b}"' in m for b in ("0.8", "1.0", "1.25")))):
                print("   ", m)
