"""Cells within 15 % (validate's relative errors) per layout and rate band, for each
validation record named. usage: python cells.py VALIDATION.json[.gz]..."""
import gzip
import json
import sys

for path in sys.argv[1:]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        rows = json.load(f)["rows"]
    bands: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        band = "0.2-0.45" if r["rate"] <= 0.45 else "0.8-1.2" if r["rate"] <= 1.2 else "1.8"
        t = bands.setdefault((r["layout"], band), [0, 0])
        for cls in r["relative_error"].values():
            for e in cls.values():
                t[1] += 1
                t[0] += e is not None and abs(e) <= 0.15
    print(path.rsplit("/", 1)[-1], "  ".join(f"{lay} {b}: {a}/{n}"
                                             for (lay, b), (a, n) in sorted(bands.items())))
