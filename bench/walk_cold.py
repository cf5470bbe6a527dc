"""The router's prefix walk, warm and cold: what one placement's `KVIndex.walk` costs.

    python -m bench.walk_cold [--out docs/bench/walk_cold.json]

`KVIndex.walk` hashes a prompt's blocks and looks each up in the index's table
(pdserve/_blockhash.c's `match`) as far as some worker holds them. Inside the router it runs
cold: between two requests the router and its neighbours run other code, so a decision
finds its data and its address translations gone (on this guest a TLB miss costs a nested
page walk). This times the walk on bench.router_scale's ~1M-block index at 64 workers over
its request stream, in one process pinned to one CPU: *warm* (back to back) and *cold*
(8 MiB written before each walk: more than this machine's L2, and every page of it a TLB
entry). The prompt comes in two forms:

- `ints`: a tuple of Python ints, one long-lived object per value made when first seen among
  other allocations (as the compiled data plane's ids tuple refers to them);
- `int32`: the same ids packed as native int32s (`memoryview.cast("i")`: what the compiled
  data plane hands placement since `match` reads them as they are; `--no-packed` skips it,
  for a tree whose `match` would read them as a sequence of ints).

Also timed: `chain` alone over the same blocks (hashing without the table). Each mean is over
every request after a warm-up, in `--rounds` passes alternating warm and cold; the median
pass is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from array import array
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench import router_scale as rs
from pdserve._blockhash import chain

EVICT_BYTES = 8 << 20


def run(rounds: int, requests: int, packed: bool) -> dict[str, Any]:
    cfg = rs.Config(index_blocks=1_000_000)
    rng = random.Random(cfg.seed)
    corpus = rs.build_corpus(rng, cfg)
    reqs = rs.decision_requests(rng, corpus, requests + 200)
    held = rs.assign_blocks(random.Random(cfg.seed * 1000 + 64), corpus, 64)
    index, _ = rs.build_index(held, rs.worker_ids(64))
    del held
    pool: dict[int, int] = {}
    junk: list[object] = []
    forms: dict[str, list[Sequence[int]]] = {"ints": []}
    for arr in reqs:
        made = []
        for v in arr:
            if v not in pool:
                pool[v] = int(str(v))
                junk.append("x" * rng.randrange(1, 200))  # other objects between them
            made.append(pool[v])
        forms["ints"].append(tuple(made))
    if packed:
        forms["int32"] = [memoryview(array("i", arr).tobytes()).cast("i") for arr in reqs]
    depths = [max((d for d, _ in index.walk(ids, rs.BLOCK_SIZE, rs.EXTRA)), default=0)
              for ids in forms["ints"]]
    evict = np.zeros(EVICT_BYTES // 8)
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})

    def mean_us(fn: Callable[[Sequence[int], int], object], prompts: list[Sequence[int]],
                cold: bool) -> float:
        total = 0
        for k, ids in enumerate(prompts[200:], start=200):
            if cold:
                np.add(evict, 1.0, out=evict)
            t0 = time.perf_counter_ns()
            fn(ids, depths[k])
            total += time.perf_counter_ns() - t0
        return total / (len(prompts) - 200) / 1e3

    def walk(ids: Sequence[int], _: int) -> object:
        return index.walk(ids, rs.BLOCK_SIZE, rs.EXTRA)

    def hashes(ids: Sequence[int], depth: int) -> object:
        return chain(ids[: (depth + 1) * rs.BLOCK_SIZE], rs.BLOCK_SIZE, rs.EXTRA, None)

    out: dict[str, Any] = {}
    for form, prompts in forms.items():
        for what, fn in (("walk", walk), ("chain", hashes)):
            for ids in prompts[:200]:
                fn(ids, 0)
            passes: dict[str, list[float]] = {"warm": [], "cold": []}
            for _ in range(rounds):
                for state in passes:
                    passes[state].append(mean_us(fn, prompts, state == "cold"))
            for state, xs in passes.items():
                out[f"{what}_{form}_{state}_us"] = round(statistics.median(xs), 2)
                out[f"{what}_{form}_{state}_passes_us"] = [round(x, 2) for x in xs]
    out["requests"] = len(reqs) - 200
    out["mean_prompt_tokens"] = round(sum(map(len, reqs[200:])) / (len(reqs) - 200))
    out["mean_blocks_held"] = round(sum(depths[200:]) / (len(reqs) - 200), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--no-packed", action="store_true", help="time the ints form only")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = run(args.rounds, args.requests, not args.no_packed)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    rec = {"benchmark": "bench.walk_cold", "commit": commit,
           "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": rs.machine(),
           "evict_bytes": EVICT_BYTES, "rounds": args.rounds, "results": result}
    text = json.dumps(rec, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
