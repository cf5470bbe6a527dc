"""GC pauses of every Python process started with this directory on PYTHONPATH (bench only).

    PYTHONPATH=bench/gc_trace GC_TRACE_DIR=/tmp/gc python -m bench.router_harness ...

Each process that exits normally and whose command line names `GC_TRACE_MATCH` (default
"router") writes GC_TRACE_DIR/stats.<pid>.json: per generation the number of collections,
their total and longest duration, and every collection over 1 ms as (seconds since start,
generation, ms, objects collected). gc.callbacks time each collection; nothing else changes.
"""

import atexit
import gc
import json
import os
import sys
import time

_OUT = os.environ.get("GC_TRACE_DIR", "/tmp/gc_trace")
_T0 = time.monotonic()
_started: dict[int, float] = {}
_gens = {g: [0, 0.0, 0.0] for g in range(3)}  # count, total s, longest s
_events: list[tuple[float, int, float, int]] = []


def _callback(phase: str, info: dict[str, int]) -> None:
    g = info["generation"]
    if phase == "start":
        _started[g] = time.perf_counter()
        return
    took = time.perf_counter() - _started.get(g, time.perf_counter())
    acc = _gens[g]
    acc[0] += 1
    acc[1] += took
    acc[2] = max(acc[2], took)
    if took > 0.001:
        _events.append((round(time.monotonic() - _T0, 2), g, round(took * 1e3, 2),
                        info.get("collected", 0)))


def _dump() -> None:
    if os.environ.get("GC_TRACE_MATCH", "router") not in " ".join(sys.argv):
        return
    os.makedirs(_OUT, exist_ok=True)
    with open(os.path.join(_OUT, f"stats.{os.getpid()}.json"), "w") as f:
        json.dump({"argv": sys.argv, "lifetime_s": time.monotonic() - _T0, "generations": _gens,
                   "frozen_at_exit": gc.get_freeze_count(), "over_1ms": _events}, f)


gc.callbacks.append(_callback)
atexit.register(_dump)
