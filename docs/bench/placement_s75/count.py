"""Cells of a bench.cluster_sim validation within 15 %, by layout and rate band (below
saturation: 0.2-0.45 req/s; 0.8-1.2). Usage: count.py VALIDATION.json[.gz]..."""

from __future__ import annotations

import sys
from pathlib import Path

from bench import records


def main() -> None:
    for name in sys.argv[1:]:
        path = Path(name.removesuffix(".gz"))
        rows = records.read_json(path)["rows"]
        bands: dict[tuple[str, str], list[bool]] = {}
        for r in rows:
            band = "0.2-0.45" if r["rate"] <= 0.45 else "0.8-1.2"
            cells = bands.setdefault((r["layout"], band), [])
            for errs in r["relative_error"].values():
                cells += [abs(e) <= 0.15 for e in errs.values() if e is not None]
        print(path.name, "  ".join(f"{lay} {band}: {sum(c)}/{len(c)}"
                                   for (lay, band), c in sorted(bands.items())))


if __name__ == "__main__":
    main()
