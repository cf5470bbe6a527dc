"""Median / p90 of the stage intervals in each light_<run>.txt.gz here (ms):
python summarize.py base tup1 np1 tup2 c1 cpu1 n1 y1 y2"""

import gzip
import sys
from pathlib import Path

PAIRS = ("0:h", "t:rq", "pl0:pl1", "pl1:w0", "0:sub", "rep:ev", "rep:resp", "h:sub", "ch:csub")


def main() -> None:
    here = Path(__file__).parent
    for name in sys.argv[1:]:
        rows = []
        for line in gzip.open(here / f"light_{name}.txt.gz", "rt"):
            d: dict[str, float] = {}
            for kv in line.split():
                k, v = kv.split("=")
                if k != "id":
                    d.setdefault(k, float(v))
            rows.append(d)
        out = []
        for pair in PAIRS:
            a, b = pair.split(":")
            xs = sorted(r[b] - (r[a] if a != "0" else 0.0) for r in rows
                        if b in r and (a == "0" or a in r))
            if xs:
                out.append(f"{pair} {xs[len(xs) // 2]:.3f}/{xs[int(len(xs) * 0.9)]:.3f}")
        print(name, len(rows), " | ".join(out))


if __name__ == "__main__":
    main()
