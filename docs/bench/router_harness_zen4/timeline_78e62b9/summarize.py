"""Summarize the router's timeline stamps (`TL {...}` lines that the router of
`timeline.patch` prints, one per request at its first token) from its log.

    python summarize.py ROUTER_LOG summary.json requests_alone.json

Stamps are (perf_counter, thread_time) pairs: i = the API key interceptor entered, e = the
servicer entered, b = GenerateRequest built, q0 = the request's message queued on the
decode worker's Session, w0/w1 = the session write started/returned, r = the reply read,
g = it reached the request's generator, y0/y1 = the router's first event / its response
message built, y2 = grpc took it (the yield returned). Only requests that ran alone (no
other request in the router between their e and y2, nor overlapping the next) are kept:
the light and paired phases' unloaded requests."""
import itertools
import json
import statistics
import sys

KEYS = ["i", "e", "b", "q0", "w0", "w1", "r", "g", "y0", "y1", "y2"]
rows = [json.loads(line[3:]) for line in open(sys.argv[1]) if line.startswith("TL ")]
rows = [r for r in rows if all(k in r for k in KEYS)]
alone = [r for k, r in enumerate(rows) if 0 < k < len(rows) - 1
         and r["e"][0] > rows[k - 1]["y2"][0] and rows[k + 1]["e"][0] > r["y2"][0]]
segments = {}
for a, b in itertools.pairwise(KEYS):
    wall = [(r[b][0] - r[a][0]) * 1e6 for r in alone]
    cpu = [(r[b][1] - r[a][1]) * 1e6 for r in alone]
    segments[f"{a}->{b}"] = {"wall_us_p50": round(statistics.median(wall), 1),
                             "main_thread_cpu_us_p50": round(statistics.median(cpu), 1)}
summary = {"requests": len(rows), "requests_alone": len(alone), "segments": segments,
           "e_to_w1_us_p50": round(statistics.median(
               (r["w1"][0] - r["e"][0]) * 1e6 for r in alone), 1),
           "r_to_y1_us_p50": round(statistics.median(
               (r["y1"][0] - r["r"][0]) * 1e6 for r in alone), 1)}
json.dump(summary, open(sys.argv[2], "w"), indent=1)
# every kept request's stamps, in us from its i: [wall, main thread CPU]
json.dump([{k: [round((r[k][0] - r["i"][0]) * 1e6), round((r[k][1] - r["i"][1]) * 1e6)]
            for k in KEYS} for r in alone], open(sys.argv[3], "w"))
print(json.dumps(summary, indent=1))
