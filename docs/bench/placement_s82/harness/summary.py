"""One row per harness record, two numbers per cell (`prefix`, `prefix1`): the router's own
ms p50 / p99 (light phase), decisions per CPU-second (light, saturated), full-path requests
per router core-second (light, saturated), the router's peer count at the phases' end.
usage: python docs/bench/placement_s82/harness/summary.py FILE.json[.gz]..."""
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

    def phase(k: str, f: str) -> str:
        return ", ".join(f"{ph[f'{w}/{k}'][f]:,.0f}" for w in WORKLOADS)

    peers = sorted({ph[f"{w}/{k}"].get("peer_routers") for w in WORKLOADS
                    for k in ("light", "saturate")}, key=str)
    return (f"| {path.rsplit('/', 1)[-1]} ({d['commit']}) | {two('router_own_ms_p50_light')} "
            f"| {two('router_own_ms_p99_light')} | {phase('light', 'decisions_per_cpu_s')} "
            f"| {phase('saturate', 'decisions_per_cpu_s')} "
            f"| {phase('light', 'full_path_requests_per_router_core_s')} "
            f"| {phase('saturate', 'full_path_requests_per_router_core_s')} "
            f"| {', '.join(str(p) for p in peers)} |")


print("| record | own ms p50, light | own ms p99, light | decisions/CPU-s, light "
      "| decisions/CPU-s, saturated | requests/router core-s, light "
      "| requests/router core-s, saturated | peers |")
print("|---|---|---|---|---|---|---|---|")
for p in sys.argv[1:]:
    print(row(p))
