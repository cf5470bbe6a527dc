"""1P2D: which decode worker served each request of the real runs, from token-time
synchrony (common.assign). Prints the pair-sync distribution per run and writes the
assignment to assign_1p2d.json (informational; the other scripts recompute it)."""

import json

from common import assign, real_files

res = {}
for f in real_files("1p2d"):
    W, unknown, same, conflicts = assign(f)
    vals = sorted(same.values())
    print(
        f.split("57b2528/")[1],
        "pairs",
        len(same),
        "sync <0.25",
        sum(v < 0.25 for v in vals),
        "0.25-0.6",
        sum(0.25 <= v < 0.6 for v in vals),
        ">=0.6",
        sum(v >= 0.6 for v in vals),
        "conflicts",
        conflicts,
        "unconstrained",
        [i for i, u in unknown.items() if u],
        "worker0/worker1",
        sum(1 for v in W.values() if v == 0),
        sum(1 for v in W.values() if v == 1),
    )
    res[f] = {str(i): c for i, c in sorted(W.items())}
with open("docs/bench/cluster_sim/batch_error_s58/assign_1p2d.json", "w") as fh:
    json.dump(res, fh, indent=0)
    fh.write("\n")
