"""Remote batch requests of the real runs whose final inter-token gap exceeds 500 ms, with the
stream's median gap and whether the prefill worker was computing another prompt (server
timings) during that final gap."""

import statistics as st

from common import load, prefill_end, real_files

for layout in ("1p1d", "1p2d"):
    n = 0
    hits = []
    for f in real_files(layout):
        R = load(f)["requests"]
        iv = []
        for q in R:
            t = q.get("server_timings_ms") or {}
            if "prefill_compute_ms" in t:
                e = prefill_end(q)
                iv.append((e - t["prefill_compute_ms"] / 1e3, e, q["index"]))
        for r in R:
            if (
                not r["ok"]
                or r["latency_class"] != "batch"
                or r["route"] != "remote"
                or not r["itl_s"]
            ):
                continue
            n += 1
            last = r["itl_s"][-1]
            if last <= 0.5:
                continue
            fin = r["start_s"] + r["ttft_s"] + sum(r["itl_s"])
            busy = [i for s, e, i in iv if i != r["index"] and s < fin and e > fin - last]
            hits.append(
                f"  {'/'.join(f.split('/')[-2:])} index {r['index']}: last gap {last * 1e3:.0f} ms,"
                f" median gap {st.median(r['itl_s']) * 1e3:.0f} ms,"
                f" prefill worker computing request(s) {busy} during it"
            )
    print(f"{layout}: {len(hits)} of {n} remote batch requests with a final gap > 500 ms")
    for h in hits:
        print(h)
