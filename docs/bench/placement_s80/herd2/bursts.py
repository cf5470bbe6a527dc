"""From herd2.py's record: per pass (round, routers, concurrency), the decisions per decode
worker and the bursts (decisions logged within 0.35 s of each other, as
../../placement_s79/herd/bursts.py counts them) that all went to one worker.
usage: python bursts.py two_routers.json.gz"""
import datetime
import gzip
import json
import sys

with (gzip.open if sys.argv[1].endswith(".gz") else open)(sys.argv[1], "rt") as f:
    d = json.load(f)
dec = sorted((datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp(), w, r)
             for t, w, _, r in d["decisions"])
for p in d["passes"]:
    mine = [x for x in dec if p["start"] <= x[0] <= p["end"] + 0.5]
    bursts: list[list[tuple[float, str, str]]] = []
    for x in mine:
        if bursts and x[0] - bursts[-1][-1][0] < 0.35:
            bursts[-1].append(x)
        else:
            bursts.append([x])
    multi = [b for b in bursts if len(b) > 1]
    same = sum(1 for b in multi if len({w for _, w, _ in b}) == 1)
    per: dict[str, int] = {}
    for _, w, _ in mine:
        per[w] = per.get(w, 0) + 1
    print(f"| {p['round']} | {p['routers']} | {p['concurrency']} | {len(multi)} | {same} "
          f"| {' / '.join(f'{per.get(w, 0)}' for w in ('decode-0', 'decode-1'))} "
          f"| {p['ttft_p50_ms']:.0f} | {p['tpot_p50_ms']:.1f} | {p['errors']} |")
