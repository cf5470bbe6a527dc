"""RSS the router's index takes: bench.router_scale's 1M-block index built for N workers in
a fresh process, RSS (VmRSS) after minus before the build (the corpus built first and
kept): python index_rss.py N (PYTHONPATH = the repository)."""

import gc
import json
import random
import sys
from dataclasses import replace

from bench.router_scale import (
    MAX_OPS_PER_ENTRY,
    Config,
    assign_blocks,
    build_corpus,
    snapshot_batches,
    worker_ids,
)
from router.kv_index import Applied, KVEventBatch, KVIndex


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


n = int(sys.argv[1])
corpus = build_corpus(random.Random(1), replace(Config(), index_blocks=1_000_000))
held = assign_blocks(random.Random(1000 + n), corpus, n)
gc.collect()
before = rss()
index = KVIndex()
for wid, hashes in zip(worker_ids(n), held, strict=True):
    for b in snapshot_batches(hashes):
        batch = KVEventBatch.from_fields(b.to_fields(), max_ops=MAX_OPS_PER_ENTRY)
        assert index.apply(wid, batch) is Applied.OK
gc.collect()
after = rss()
print(json.dumps({"workers": n, "index_blocks": index.num_blocks,
                  "slot_bytes": getattr(index._holders, "slot_bytes", 32),
                  "rss_growth_bytes": after - before,
                  "rss_bytes_per_block": (after - before) / index.num_blocks}))
