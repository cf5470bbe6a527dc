"""From share.py's record: per pass (round, mode, concurrency), the decisions per decode worker
and the bursts (decisions logged within 0.35 s of each other, whichever router made them, as
../../placement_s80/herd2/bursts.py counts them) that all went to one worker; then per mode
and concurrency over the rounds.
usage: python bursts.py share.json.gz"""
import datetime
import gzip
import json
import statistics
import sys

with (gzip.open if sys.argv[1].endswith(".gz") else open)(sys.argv[1], "rt") as f:
    d = json.load(f)
dec = sorted((datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp(), w, r)
             for t, w, _, r in d["decisions"])
totals: dict[tuple[str, int], list[dict[str, float]]] = {}
print("| round | mode | streams | bursts of 2+ | all on one worker | decisions decode-0 / "
      "decode-1 | TTFT p50 (ms) | TPOT p50 (ms) | errors |")
print("|---|---|---|---|---|---|---|---|---|")
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
    totals.setdefault((p["mode"], p["concurrency"]), []).append(
        {"multi": len(multi), "same": same, "ttft": p["ttft_p50_ms"], "tpot": p["tpot_p50_ms"],
         "errors": p["errors"]})
    print(f"| {p['round']} | {p['mode']} | {p['concurrency']} | {len(multi)} | {same} "
          f"| {' / '.join(f'{per.get(w, 0)}' for w in ('decode-0', 'decode-1'))} "
          f"| {p['ttft_p50_ms']:.0f} | {p['tpot_p50_ms']:.1f} | {p['errors']} |")
print()
print("| mode | streams | bursts all on one worker / bursts of 2+ | TTFT p50 (ms), median of "
      "rounds | TPOT p50 (ms), median of rounds | errors |")
print("|---|---|---|---|---|---|")
for (mode, c), rows in sorted(totals.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"| {mode} | {c} | {sum(r['same'] for r in rows)} / {sum(r['multi'] for r in rows)} "
          f"| {statistics.median(r['ttft'] for r in rows):.0f} "
          f"| {statistics.median(r['tpot'] for r in rows):.1f} "
          f"| {sum(r['errors'] for r in rows)} |")
