"""Per bench.sim.real record (its cost system): the router's decisions by route and its
first tokens over cost placement's predictions (pdserve_router_ttft_prediction_ratio): count,
mean and the cumulative buckets. Usage: ratios.py RECORD_DIR..."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def value(line: str) -> float:
    return float(line.split()[-1])


def main() -> None:
    for root in map(Path, sys.argv[1:]):
        setup = json.loads((root / "setup.json").read_text())
        metrics = setup["systems"]["1p2d-cost"]["router_metrics"]
        print(root.name)
        for route in ("local", "remote"):
            mine = [m for m in metrics if f'route="{route}"' in m]
            count = sum(value(m) for m in mine if "prediction_ratio_count" in m)
            total = sum(value(m) for m in mine if "prediction_ratio_sum" in m)
            buckets = [(bound.group(1), value(m)) for m in mine
                       if "prediction_ratio_bucket" in m
                       and (bound := re.search(r'le="([^"]+)"', m))]
            mean = total / count if count else float("nan")
            print(f"  {route}: n={count:.0f} mean={mean:.2f} cumulative={buckets}")


if __name__ == "__main__":
    main()
