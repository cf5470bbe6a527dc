"""Real batch prompts' prefill compute time (the prefill worker's server timing) against the
profile's lone-prompt prefill (bench.cluster_sim.prefill_s: 512-token chunks on an idle
engine, engine_profile_spr_5bfee06), split by whether another prompt's prefill overlapped
it on the prefill worker."""

import statistics as st
from pathlib import Path

from common import PROFILE, load, prefill_end, real_files

from bench.cluster_sim import prefill_s
from bench.sim.workers import StepCost

cost = StepCost.load(Path(PROFILE))
for layout in ("1p1d", "1p2d"):
    iso, shared = [], []
    for f in real_files(layout):
        iv = []
        for r in load(f)["requests"]:
            t = r.get("server_timings_ms") or {}
            if "prefill_compute_ms" not in t:
                continue
            end = prefill_end(r)
            iv.append((end - t["prefill_compute_ms"] / 1e3, end, r))
        for s, e, r in iv:
            if r["latency_class"] != "batch":
                continue
            others = any(not (e2 <= s or s2 >= e) for s2, e2, q in iv if q is not r)
            ratio = (
                r["server_timings_ms"]["prefill_compute_ms"]
                / 1e3
                / prefill_s(cost, r["prompt_tokens"])
            )
            (shared if others else iso).append(ratio)
    print(
        f"{layout} batch prefill compute / profile lone-prompt prefill:"
        f" isolated n={len(iso)} median {st.median(iso):.2f}"
        f" range {min(iso):.2f}-{max(iso):.2f}"
        f" | overlapping another prompt n={len(shared)} median {st.median(shared):.2f}"
    )
print(f"profile lone 1146-token prefill: {prefill_s(cost, 1146):.2f} s")
