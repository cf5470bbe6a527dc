"""Each step's time in the stamped router's records (marks.patch writes one list of
(step, perf_counter) per request): p50 / p90 / mean per step over a window of requests.

    python marks.py MARKS.json[.gz] [SKIP] [FROM:TO]"""

import gzip
import itertools
import json
import statistics
import sys
from collections import defaultdict

path = sys.argv[1]
with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
    d = json.load(f)
skip = int(sys.argv[2]) if len(sys.argv) > 2 else 0
lo, hi = (int(x) for x in sys.argv[3].split(":")) if len(sys.argv) > 3 else (skip, len(d))
d = d[lo:hi]
deltas: dict[str, list[float]] = defaultdict(list)
order = []
for m in d:
    for (a, ta), (b, tb) in itertools.pairwise(m):
        k = f"{a}->{b}"
        if k not in deltas:
            order.append(k)
        deltas[k].append((tb - ta) * 1e6)
    deltas["TOTAL"].append((m[-1][1] - m[0][1]) * 1e6)
order.append("TOTAL")
for k in order:
    v = sorted(deltas[k])
    print(f"{k:28s} n={len(v):5d} p50={v[len(v) // 2]:8.1f} p90={v[int(len(v) * 0.9)]:8.1f} "
          f"mean={statistics.mean(v):8.1f} us")
