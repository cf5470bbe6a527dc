"""What a router pays to take in one peer's pushed in-flight counts (router.ledger), with
256 decode workers and 1, 3 or 7 peers (2, 4, 8 routers). Each peer's record holds 4
requests on every worker and a departure on each; each push has one more request on one
worker than the one before, or one fewer (as a placement or an end moves them).
Up to stop 81 a push rebuilt the views from every peer's counts (`merge` of all of them:
O(peers x workers)); from stop 82 the router takes in only the pusher's (`take`: what moved
in its counts). Run it at each tree, PYTHONPATH at it: it measures `take` where the ledger
has it, else the old `merge`. No Redis, no parsing (../placement_s81/inflight_cost.py
measures reading a record). Prints the CPU model and flags and the commit first.
usage: PYTHONPATH=TREE python docs/bench/placement_s82/push_cost.py"""
import platform
import re
import subprocess
import time
from pathlib import Path

from pdserve.control.inflight import InflightCounts
from pdserve.control.load import WorkerLoad
from router.ledger import PlacementLedger, load_tag

cpu = Path("/proc/cpuinfo").read_text()
model = re.search(r"model name\s*:\s*(.*)", cpu)
flags = set(re.search(r"flags\s*:\s*(.*)", cpu).group(1).split())  # type: ignore[union-attr]
known = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
tree = Path(__import__("router").__file__).resolve().parent.parent
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True, cwd=tree).stdout.strip()
print(f"cpu: {model.group(1) if model else platform.processor()}; "
      f"{' '.join(f for f in known if f in flags)}; tree {tree} at {commit}")

WORKERS = 256
load = WorkerLoad(running=4, free_blocks=100, total_blocks=100)
workers = [f"decode-{i}" for i in range(WORKERS)]
tag = load_tag(load)


def counts(router: str, seq: int) -> InflightCounts:
    placed = {w: 4 for w in workers}
    placed[workers[seq // 2 % WORKERS]] += seq % 2
    return InflightCounts(router, placed, {w: (1, tag) for w in workers}, seq)


for peers in (1, 3, 7):
    ledger = PlacementLedger()
    ledger.saw_loads([(w, load) for w in workers], 0.1)
    held = {f"peer{p}": counts(f"peer{p}", 1) for p in range(peers)}
    ledger.merge(held.values())
    pushes = [counts("peer0", s) for s in range(2, 2002)]
    take = getattr(ledger, "take", None)
    start = time.perf_counter()
    for c in pushes:
        if take is not None:
            take(c)
        else:
            held["peer0"] = c
            ledger.merge(held.values())
    per = (time.perf_counter() - start) / len(pushes)
    print(f"workers {WORKERS}, peers {peers}: {'take' if take else 'merge of all'} "
          f"{per * 1e6:.0f} us per push received")
