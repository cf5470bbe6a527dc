"""KV transfer of the real remote batch requests (server timings kv_bytes, kv_transfer_ms)
against the simulator's transfer price (validation_spr_704c56d calibration
overheads.transfer_s_per_token)."""

import statistics as st

from common import load, overheads, real_files

for layout in ("1p1d", "1p2d"):
    mb, ms, us = [], [], []
    for f in real_files(layout):
        for r in load(f)["requests"]:
            t = r.get("server_timings_ms") or {}
            if (
                r["ok"]
                and r["latency_class"] == "batch"
                and r["route"] == "remote"
                and "kv_transfer_ms" in t
            ):
                mb.append(t["kv_bytes"] / 1e6)
                ms.append(t["kv_transfer_ms"])
                us.append(t["kv_transfer_ms"] * 1e3 / r["prompt_tokens"])
    price = overheads(layout)["transfer_s_per_token"] * 1e6
    print(
        f"{layout} remote batch requests n={len(mb)}:"
        f" KV {st.median(mb):.1f} MB median ({min(mb):.1f}-{max(mb):.1f}),"
        f" transfer {st.median(ms):.1f} ms median ({min(ms):.1f}-{max(ms):.1f}),"
        f" {st.median(us):.1f} us/prompt token median ({min(us):.1f}-{max(us):.1f});"
        f" simulator price {price:.0f} us/token = {price * 1146 / 1e3:.0f} ms for 1146 tokens"
    )
