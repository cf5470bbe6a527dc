"""Long event-loop steps by what ran them, from a `bench/loop_trace` file.

    python -m bench.loop_trace.summarize STEPS.jsonl [--skip-s 30] [--json OUT]

Per kind of step (a task's name and coroutine; a request's steps are all
``HandleExceptions[<method>]``): how many were over the threshold, their total, median, p90
and longest ms; and the callbacks per second, from the ``counts`` lines. `--skip-s` leaves
out what came in the first seconds (a harness's start-up: index snapshots, warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def summarize(path: Path, skip_s: float = 0.0) -> dict[str, Any]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    counts = [r for r in rows if r[0] == "counts"]
    t0 = min(r[1] for r in counts) if counts else 0.0
    by: dict[str, list[float]] = defaultdict(list)
    for stamp, ms, what in (r for r in rows if r[0] != "counts"):
        if stamp - t0 >= skip_s:
            by[what].append(ms)
    kinds = {}
    for what, ms in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        ms.sort()
        kinds[what] = {"n": len(ms), "total_ms": round(sum(ms), 1),
                       "p50_ms": round(statistics.median(ms), 3),
                       "p90_ms": ms[int(0.9 * (len(ms) - 1))], "max_ms": ms[-1]}
    span = counts[-1][1] - t0 if len(counts) > 1 else 0.0
    return {"file": str(path), "skip_s": skip_s, "span_s": round(span, 1),
            "callbacks": counts[-1][2] if counts else 0, "steps_over_threshold": kinds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("steps", type=Path)
    p.add_argument("--skip-s", type=float, default=0.0)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    out = summarize(a.steps, a.skip_s)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    for what, k in list(out["steps_over_threshold"].items())[:15]:
        print(f"{k['n']:6d} total {k['total_ms']:8.1f} ms  p50 {k['p50_ms']:6.2f}  "
              f"p90 {k['p90_ms']:6.2f}  max {k['max_ms']:6.2f}  {what[:90]}")


if __name__ == "__main__":
    main()
