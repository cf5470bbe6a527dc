"""One table row per harness record: own ms p50/p99 (light, paired), decisions per
CPU-second (light, saturated), others' share of the router's core (light, saturated), hit
rate over the oracle's (saturated), the index check; two numbers each: `prefix`, `prefix1`.
usage: python docs/bench/dataplane_s79/summary.py FILE.json..."""
import gzip
import json
import sys


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


for path in sys.argv[1:]:
    d = load(path)
    r = d["results"][0]
    v = {x["workload"]: x for x in d["verdicts"]}
    ph = r["phases"]
    wl = ("prefix", "prefix1")

    def two(f: str, src: dict = v) -> str:
        return ", ".join(f"{src[w][f]:.2f}" if isinstance(src[w][f], float) else str(src[w][f])
                         for w in wl)

    def phase(k: str, f: str) -> str:
        return ", ".join(f"{ph[f'{w}/{k}'][f]:,.0f}" for w in wl)

    others = [ph[f"{w}/{k}"]["others_on_router_core"] for k in ("light", "saturate")
              for w in wl]
    hits = ", ".join(f"{ph[f'{w}/saturate']['hit_rate_vs_oracle']:.3f}" for w in wl)
    chk = r.get("index_check", {})
    print(f"| {path.rsplit('/', 1)[-1]} ({d['commit']}) | {two('router_own_ms_p50_light')} "
          f"| {two('router_own_ms_p99_light')} | {two('router_own_ms_p50_paired')} "
          f"| {two('router_own_ms_p99_paired')} | {phase('light', 'decisions_per_cpu_s')} "
          f"| {phase('saturate', 'decisions_per_cpu_s')} "
          f"| {', '.join(f'{x:.2f}' for x in others)} "
          f"| {hits} "
          f"| {chk.get('router_index_blocks')} / {chk.get('workers_distinct_blocks')}, "
          f"follower {chk.get('follower_index_equals_caches')} |")
