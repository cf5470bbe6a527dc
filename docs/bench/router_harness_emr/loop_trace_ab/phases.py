"""Each task's loop steps over 0.25 ms in the light and saturate phases of a loop-traced
harness run (`bench/loop_trace`): python phases.py DIR... (each DIR holds steps.jsonl or
steps.jsonl.gz). The phases are found by the harness's /metrics scrapes, which come between
them (the router's `run_asgi` steps): the light phase lies between the third-last and the
second-last cluster of scrapes, the saturate phase between the last two."""

import gzip
import json
import sys
from pathlib import Path


def q(xs: list[float], p: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(len(xs) * p))], 2) if xs else None


for d in sys.argv[1:]:
    path = Path(d) / "steps.jsonl"
    opener = open if path.exists() else gzip.open
    with opener(path if path.exists() else Path(d) / "steps.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if r[0] != "counts"]
    t0 = rows[0][0]
    scrapes = sorted({int(r[0] - t0) for r in rows if "run_asgi" in r[2]})
    clusters: list[list[int]] = []
    for s in scrapes:
        if not clusters or s - clusters[-1][-1] > 2:
            clusters.append([s])
        else:
            clusters[-1].append(s)
    phases = ((clusters[-3][-1] + 1, clusters[-2][0], "light"),
              (clusters[-2][-1] + 1, clusters[-1][0], "saturate"))
    for a, b, ph in phases:
        for name in ["directory", "follower", "Generate"]:
            xs = [r[1] for r in rows if name in r[2] and a <= r[0] - t0 < b]
            print(Path(d).name, ph, f"{a}-{b}s", name, "n", len(xs),
                  "ms/s", round(sum(xs) / (b - a), 1), "p50", q(xs, .5), "p90", q(xs, .9),
                  "max", round(max(xs), 2) if xs else None, ">1.5ms", sum(x > 1.5 for x in xs))
