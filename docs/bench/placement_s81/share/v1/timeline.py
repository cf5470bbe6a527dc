"""One pass of a share.py record, decision by decision: when (s from the pass's start),
which router, which worker, when the request ended, and the requests each worker ran at
that moment (their start times), from the record's decisions and ends.
usage: python timeline.py RECORD.json[.gz] ROUND MODE STREAMS"""
import datetime
import gzip
import json
import sys


def ts(t: str) -> float:
    return datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()


with (gzip.open if sys.argv[1].endswith(".gz") else open)(sys.argv[1], "rt") as f:
    d = json.load(f)
end = {rid: ts(t) for t, rid, _ in d["ends"]}
placed = sorted((ts(t), w, rid, r) for t, w, rid, r in d["decisions"])
(p,) = [p for p in d["passes"] if p["round"] == int(sys.argv[2]) and p["mode"] == sys.argv[3]
        and p["concurrency"] == int(sys.argv[4])]
t0 = p["start"]
for t, w, rid, r in (x for x in placed if p["start"] <= x[0] <= p["end"] + 0.5):
    running = {x: [round(s - t0, 2) for s, v, q, _ in placed if v == x and s < t < end.get(q, 1e18)]
               for x in ("decode-0", "decode-1")}
    print(f"{t - t0:7.2f} {r:9s} -> {w}  ends {end.get(rid, 0) - t0:7.2f}  running {running}")
