"""Medians of the router's stamps (timeline.patch) over the requests that were alone in it.

The patched router appended one line per request to /tmp/own_stamps.jsonl (perf_counter
stamps). A request is alone when the one before it was done before it arrived and the one
after it arrived after it was done (the paired phase's requests, some of the light phase's);
requests_alone.json keeps those, in us after each one's arrival.

usage: python summarize.py requests_alone.json > summary.json"""

import itertools
import json
import statistics
import sys

ORDER = ["arrived", "servicer", "built", "admitted", "placed", "encoding", "queued", "writer",
         "forwarded", "replied", "got", "ev", "resp", "done"]

record = json.load(open(sys.argv[1]))
alone = record["rows"]
steps = {}
for a, b in itertools.pairwise(ORDER):
    d = sorted(r[b] - r[a] for r in alone if a in r and b in r)
    steps[f"{a} -> {b}"] = {"p50_us": round(statistics.median(d)),
                            "p90_us": round(d[int(len(d) * 0.9)]), "n": len(d)}
own = sorted((r["forwarded"] - r["arrived"]) + (r["done"] - r["replied"]) for r in alone)
print(json.dumps({"requests": record["requests_stamped"], "alone": len(alone), "steps": steps,
                  "own_us": {"p50": round(statistics.median(own)),
                             "p99": round(own[int(len(own) * 0.99)])}}, indent=1))
