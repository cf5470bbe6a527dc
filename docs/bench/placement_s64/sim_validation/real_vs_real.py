"""Two real sweeps of the same layout and trace against each other, cell by cell, with the
simulator validation's own metrics (`bench.cluster_sim.metrics_of`) and count (`within`):
how far a repeat of the real cluster lands from itself. PYTHONPATH = the repository.

    python real_vs_real.py A_DIR B_DIR LAYOUT [--tol 0.15] [--json OUT]

A_DIR, B_DIR: bench.goodput / bench.sim.real output folders (a sub-folder per system of
LAYOUT's, `rate_*.json` in each); the relative difference is B / A - 1."""

import argparse
import json
from pathlib import Path

from bench.cluster_sim import SYSTEMS, metrics_of, within


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("layout", choices=sorted(SYSTEMS))
    ap.add_argument("--tol", type=float, default=0.15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for system, policy in SYSTEMS[args.layout]:
        for pa in sorted((args.a / system).glob("rate_*.json")):
            pb = args.b / system / pa.name
            if not pb.exists():
                continue
            ra, rb = json.loads(pa.read_text()), json.loads(pb.read_text())
            ma, mb = metrics_of(ra["summary"]), metrics_of(rb["summary"])
            same_trace = [(q["prompt_tokens"], q["max_tokens"]) for q in ra["requests"]] == [
                (q["prompt_tokens"], q["max_tokens"]) for q in rb["requests"]]
            err = {g: {k: None if not m.get(k) or not mb.get(g, {}).get(k)
                       else round(mb[g][k] / m[k] - 1, 3) for k in m} for g, m in ma.items()}
            rows.append({"policy": policy, "rate": ra["config"]["rate"],
                         "same_trace": same_trace, "a": ma, "b": mb, "relative_error": err})
            bad = [f"{g}.{k}={e:+.2f}" for g, es in err.items() for k, e in es.items()
                   if e is not None and abs(e) > args.tol]
            print(policy, ra["config"]["rate"], "same trace" if same_trace else "OTHER TRACE",
                  "outside:", bad)
    counts = within(rows, args.tol)
    print(json.dumps(counts, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"a": str(args.a), "b": str(args.b),
                                         "layout": args.layout, "tol": args.tol,
                                         "within": counts, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
