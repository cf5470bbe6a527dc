"""One table row per harness record: own ms p50/p99 (light, paired), decisions per
CPU-second (light, saturated), others' share of the router's core (light, saturated), hit
rate over the oracle's (saturated), the index check; two numbers each: `prefix`, `prefix1`.
usage: python docs/bench/dataplane_s79/summary.py FILE.json..."""
import gzip
import json
import sys

WORKLOADS = ("prefix", "prefix1")


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def row(path: str) -> str:
    d = load(path)
    r = d["results"][0]
    v = {x["workload"]: x for x in d["verdicts"]}
    ph = r["phases"]

    def two(f: str) -> str:
        return ", ".join(f"{v[w][f]:.2f}" for w in WORKLOADS)

    def phase(k: str, f: str, fmt: str = ",.0f") -> str:
        return ", ".join(f"{ph[f'{w}/{k}'][f]:{fmt}}" for w in WORKLOADS)

    chk = r.get("index_check", {})
    return (f"| {path.rsplit('/', 1)[-1]} ({d['commit']}) | {two('router_own_ms_p50_light')} "
            f"| {two('router_own_ms_p99_light')} | {two('router_own_ms_p50_paired')} "
            f"| {two('router_own_ms_p99_paired')} | {phase('light', 'decisions_per_cpu_s')} "
            f"| {phase('saturate', 'decisions_per_cpu_s')} "
            f"| {phase('light', 'others_on_router_core', '.2f')}; "
            f"{phase('saturate', 'others_on_router_core', '.2f')} "
            f"| {phase('saturate', 'hit_rate_vs_oracle', '.3f')} "
            f"| {chk.get('router_index_blocks')} / {chk.get('workers_distinct_blocks')}, "
            f"follower {chk.get('follower_index_equals_caches')} |")


for p in sys.argv[1:]:
    print(row(p))
