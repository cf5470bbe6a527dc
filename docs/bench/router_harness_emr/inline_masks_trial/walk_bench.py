"""The index's prefix walk (`KVIndex.walk`, pdserve._blockhash.match over the BlockTable)
over bench.router_scale's 1M-block index and request mix, pinned to CPU 0: warm (one call
after another) and cold (64 MiB of memory swept before each call, as the router's loop does
between requests), with the index's memory: python walk_bench.py N (PYTHONPATH = the
repository)."""

import json
import os
import random
import sys
import time
from dataclasses import replace

from bench.router_scale import (
    BLOCK_SIZE,
    EXTRA,
    Config,
    assign_blocks,
    build_corpus,
    build_index,
    decision_requests,
    worker_ids,
)

n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
cfg = replace(Config(), index_blocks=1_000_000)
rng = random.Random(1)
corpus = build_corpus(rng, cfg)
reqs = decision_requests(rng, corpus, 1200)
held = assign_blocks(random.Random(1000 + n), corpus, n)
index, mem = build_index(held, worker_ids(n))
del held
os.sched_setaffinity(0, {0})
extra = EXTRA
sweep = bytearray(64 << 20)
out: dict[str, object] = {"workers": n, "index_blocks": index.num_blocks,
                          "index_memory_bytes": index.memory_bytes(),
                          "slot_bytes": getattr(index._holders, "slot_bytes", 32),
                          "build": mem}
blocks = 0
for mode in ("warm", "cold", "warm2", "cold2", "warm3", "cold3"):
    lat = []
    for k, ids in enumerate(reqs):
        ids = list(ids)
        if mode.startswith("cold"):
            sweep[::64] = bytes(len(sweep) // 64)  # touch a line in every 64 bytes
        t0 = time.perf_counter_ns()
        pairs = index.walk(ids, BLOCK_SIZE, extra)
        t1 = time.perf_counter_ns()
        if k >= 200:
            lat.append(t1 - t0)
            if mode == "warm":
                blocks += max((d for d, _ in pairs), default=0)
    lat.sort()
    out[mode] = {"p50_us": lat[len(lat) // 2] / 1e3, "mean_us": sum(lat) / len(lat) / 1e3,
                 "p90_us": lat[int(len(lat) * 0.9)] / 1e3}
out["mean_depth_blocks"] = blocks / (len(reqs) - 200)
print(json.dumps(out))
