"""From ab.py's records: per run, the decisions per decode worker, and the bursts (decisions
logged within 0.35 s of each other: requests that arrived together; the router logs a
decision when its first token leaves) that all went to one worker.
usage: python bursts.py before_1.json after_1.json ..."""
import datetime
import json
import sys

for path in sys.argv[1:]:
    with open(path) as f:
        d = json.load(f)
    dec = sorted((datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp(), w)
                 for t, w, _ in d["decisions"])
    bursts, cur = [], [dec[0]]
    for x in dec[1:]:
        if x[0] - cur[-1][0] < 0.35:
            cur.append(x)
        else:
            bursts.append(cur)
            cur = [x]
    bursts.append(cur)
    multi = [b for b in bursts if len(b) > 1]
    same = sum(1 for b in multi if len({w for _, w in b}) == 1)
    per: dict[str, int] = {}
    for _, w in dec:
        per[w] = per.get(w, 0) + 1
    runs = " ".join(f"c={c}: TTFT p50 {r['ttft_p50_ms']:.0f} ms, TPOT p50 {r['tpot_p50_ms']:.1f}"
                    for c, r in d["runs"].items())
    print(f"{path}: {per}; bursts of 2+: {len(multi)}, all on one worker: {same}; {runs}")
