"""Per record, system and rate: the prompts cost placement sent to the prefill worker, by
latency class, with their prompt lengths and the prefill worker's compute time (the
server's timings), and the interactive TTFT p50/p99. Usage: remote_prompts.py RECORD_DIR..."""

from __future__ import annotations

import sys
from pathlib import Path

from bench import records


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    for root in map(Path, sys.argv[1:]):
        print(f"## {root.name}")
        print("| system | rate | interactive remote | their tokens | their prefill compute s "
              "| batch/standard remote | interactive TTFT p50 / p99 s |")
        print("|---|---|---|---|---|---|---|")
        for system in sorted(p for p in root.iterdir() if p.is_dir()):
            for rate in sorted(system.glob("rate_*.json*"), key=lambda p: float(
                    p.name.removeprefix("rate_").split(".json")[0])):
                name = rate.name.split(".json")[0]
                reqs = records.read_json(rate.with_name(name + ".json"))["requests"]
                inter = [r for r in reqs if r["latency_class"] == "interactive"]
                remote = [r for r in inter if r.get("route") == "remote"]
                compute = [((r.get("server_timings_ms") or {}).get("prefill_compute_ms") or 0)
                           / 1000 for r in remote]
                others = sum(1 for r in reqs if r["latency_class"] != "interactive"
                             and r.get("route") == "remote")
                ttft = [r["ttft_s"] for r in inter if r.get("ttft_s") is not None]
                toks = f"{min(r['prompt_tokens'] for r in remote)}-" \
                       f"{max(r['prompt_tokens'] for r in remote)}" if remote else "-"
                comp = f"{min(compute):.2f}-{max(compute):.2f}" if compute else "-"
                print(f"| {system.name} | {name.removeprefix('rate_')} | {len(remote)} of "
                      f"{len(inter)} | {toks} | {comp} | {others} | "
                      f"{pct(ttft, 0.5):.2f} / {pct(ttft, 0.99):.2f} |")
        print()


if __name__ == "__main__":
    main()
