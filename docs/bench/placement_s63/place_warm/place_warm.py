"""`router.placement.place` timed in a loop (warm) over bench.router_scale's 1M-block index
and request mix, pinned to CPU 0, with its cProfile: python place_warm.py N PLACEMENT
(PYTHONPATH = the repository; PLACEMENT cost or threshold)."""

import os
import random
import sys
from dataclasses import replace

import router.placement
from bench.router_scale import (
    Config,
    assign_blocks,
    build_corpus,
    build_index,
    decision_requests,
    fleet,
    profile_place,
    time_place,
    worker_ids,
)
from router.placement import DecodeTable
from router.policy import RouterPolicy

# The router passes its one cost model to every place(); called without one, place() at
# 8e5b9f8 built a CostModel per call (and so priced the columns again per call).
_MODEL = router.placement.CostModel()
router.placement.CostModel = lambda: _MODEL  # type: ignore[assignment,misc]

n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
cfg = replace(Config(), index_blocks=1_000_000)
rng = random.Random(1)
corpus = build_corpus(rng, cfg)
reqs = decision_requests(rng, corpus, 1200)
held = assign_blocks(random.Random(1000 + n), corpus, n)
index, _ = build_index(held, worker_ids(n))
del held
decoders, prefills, placed = fleet(random.Random(1 + n), n)
os.sched_setaffinity(0, {0})
policy = RouterPolicy(placement=sys.argv[2] if len(sys.argv) > 2 else "cost")
table = DecodeTable()
time_place(reqs[:200], decoders, prefills, index, placed, policy, table)
lat, cpu, cached = time_place(reqs[200:], decoders, prefills, index, placed, policy, table)
lat.sort()
print(n, "place p50 us", lat[len(lat) // 2] / 1e3, "mean", sum(lat) / len(lat) / 1e3,
      "cpu mean", sum(cpu) / len(cpu) / 1e3, "prefills", len(prefills))
for row in profile_place(reqs[200:600], decoders, prefills, index, placed, policy, top=14):
    print(row)
