"""A/B of the herding fix's cost per decision (9d59a04): cost placement with the ledger's
`finished` empty (as before it) and holding half the decode workers (1-3 each), alternated
request by request (so drift lands on both), caches cold between decisions (4 MiB read, as
bench.router_scale --cold-kib 4096), bench.router_scale's corpus, index (300K blocks) and
fleet; CPU time of each `place` call on its thread, pinned to core 1.
usage: finished_ab.py WORKERS"""
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import time

from bench import router_scale as rs
from pdserve.types import LatencyClass
from router.placement import DecodeTable, place
from router.policy import RouterPolicy

n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
cfg = dataclasses.replace(rs.Config(), index_blocks=300_000, decision_requests=2000,
                          warmup=200, placement="cost", cold_kib=4096)
rng = random.Random(cfg.seed)
corpus = rs.build_corpus(rng, cfg)
reqs = rs.decision_requests(rng, corpus, cfg.warmup + cfg.decision_requests)
warm, timed = reqs[: cfg.warmup], reqs[cfg.warmup :]
held = rs.assign_blocks(random.Random(cfg.seed * 1000 + n), corpus, n)
index, _ = rs.build_index(held, rs.worker_ids(n))
del held
decoders, prefills, placed = rs.fleet(random.Random(cfg.seed + n), n)
frng = random.Random(7)
half = {w.worker_id: float(frng.randint(1, 3)) for w in frng.sample(decoders, n // 2)}
variants = ({}, half)
policy = RouterPolicy(placement="cost")
evict = rs.cache_evictor(cfg.cold_kib)
os.sched_setaffinity(0, {1})
gc.collect()
table = DecodeTable()
for arr in warm:
    place(arr.tolist(), LatencyClass.STANDARD, decoders, prefills, index, placed, policy,
          table=table, finished=half)
cpu = {0: [], 1: []}
for r in range(4):
    for k, arr in enumerate(timed):
        v = (k + r) % 2
        ids = arr.tolist()
        evict()
        c0 = time.thread_time_ns()
        place(ids, LatencyClass.STANDARD, decoders, prefills, index, placed, policy,
              table=table, finished=variants[v])
        cpu[v].append(time.thread_time_ns() - c0)
    print(r, {("empty", "half")[v]: round(statistics.fmean(x[-len(timed) // 2:]) / 1e3, 2)
              for v, x in cpu.items()}, flush=True)
res = {("empty", "half")[v]: {"cpu_us_mean": round(statistics.fmean(x) / 1e3, 2),
                             "cpu_us_p50": round(statistics.median(x) / 1e3, 2),
                             "decisions": len(x)} for v, x in cpu.items()}
print(json.dumps({"workers": n, "index_blocks": index.num_blocks, **res}))
