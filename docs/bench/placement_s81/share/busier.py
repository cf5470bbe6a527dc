"""From share.py's record: how often a decision sent a request to the busier decode worker.
At each decision, the requests running on each worker are counted from the record itself
(every router's decisions and request ends, on one clock: a request runs from its decision
to its end); a decision is *busier* when the worker it chose ran more of them than the other
one did. Per pass, then per mode and concurrency over the rounds: decisions, busier ones,
and the mean gap |running on decode-0 - running on decode-1| the decisions met.
usage: python busier.py share.json.gz"""
import datetime
import gzip
import json
import sys

WORKERS = ("decode-0", "decode-1")


def ts(t: str) -> float:
    return datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()


with (gzip.open if sys.argv[1].endswith(".gz") else open)(sys.argv[1], "rt") as f:
    d = json.load(f)
end = {rid: ts(t) for t, rid, _ in d["ends"]}
placed = sorted((ts(t), w, rid) for t, w, rid, _ in d["decisions"])
spans = [(t, end.get(rid, float("inf")), w) for t, w, rid in placed]
totals: dict[tuple[str, int], list[float]] = {}
print("| round | mode | streams | decisions | to the busier worker | mean gap met |")
print("|---|---|---|---|---|---|")
for p in d["passes"]:
    mine = [(t, w) for t, w, _ in placed if p["start"] <= t <= p["end"] + 0.5]
    busier, gap = 0, 0.0
    for t, w in mine:
        running = {x: sum(1 for s, e, v in spans if v == x and s < t < e) for x in WORKERS}
        busier += running[w] > min(running.values())
        gap += abs(running[WORKERS[0]] - running[WORKERS[1]])
    n = len(mine)
    acc = totals.setdefault((p["mode"], p["concurrency"]), [0, 0, 0.0])
    acc[0] += n
    acc[1] += busier
    acc[2] += gap
    print(f"| {p['round']} | {p['mode']} | {p['concurrency']} | {n} | {busier} "
          f"| {gap / max(n, 1):.2f} |")
print()
print("| streams | mode | decisions | to the busier worker | mean gap met |")
print("|---|---|---|---|---|")
for (mode, c), (n, busier, gap) in sorted(totals.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"| {c} | {mode} | {n:.0f} | {busier:.0f} ({100 * busier / max(n, 1):.0f} %) "
          f"| {gap / max(n, 1):.2f} |")
