"""The A/B's rows: per run, batch TTFT p50/p90 (s), interactive TTFT p50 (ms) and TPOT
p50/p90 (ms) at 0.8 req/s. usage: python summary.py (in this directory)"""
import gzip
import json
import statistics
from pathlib import Path


def q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


for run in ("before_1_6a7ced3", "after_1_2009fa9", "before_2_6a7ced3", "after_2_2009fa9"):
    path = Path(run, "1p2d", "rate_0.8.json.gz")  # compressed in the repository
    reqs = json.loads(gzip.decompress(path.read_bytes()))["requests"]
    batch = [r["ttft_s"] for r in reqs if r["latency_class"] == "batch"]
    inter = [r for r in reqs if r["latency_class"] == "interactive"]
    tpot = [r["tpot_s"] * 1e3 for r in inter if r["tpot_s"]]
    print(f"| {run} | {statistics.median(batch):.1f} / {q(batch, 0.9):.1f} "
          f"| {statistics.median(r['ttft_s'] for r in inter) * 1e3:.0f} "
          f"| {statistics.median(tpot):.1f} / {q(tpot, 0.9):.1f} "
          f"| {sum(r['ok'] for r in reqs)}/{len(reqs)} |")
