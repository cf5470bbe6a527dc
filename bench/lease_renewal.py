"""Remote prefills slower than their lease: thrown away and redone, or let finish.

    python -m bench.lease_renewal --baseline-tree DIR --out docs/bench/X/lease_renewal.json

A decode worker holds the blocks a remote prefill writes into for a lease. Before bc898d1 the
lease ended at its first deadline (the router's `--prefill-timeout`, stretched by the prefill
worker's predicted queue): a prompt whose prefill took longer was cancelled there though its
KV was landing part by part, and prefilled again on the decode worker (route `fallback`).
Since, each part that lands renews the lease, up to `--max-prefill-timeout`.

This starts the cluster as `pdserve cluster up --prefill 1 --decode 1` does (`LocalCluster`),
with the router's `--prefill-timeout` set to `--lease` (a few seconds: shorter than the
prompts' prefill here, as 30 s is on a loaded machine), threshold placement, then sends
`--waves` waves of `--per-wave` concurrent completions of ~`--prompt-tokens` distinct tokens
(latency class batch, `--max-tokens` greedy tokens, `X-Pdserve-Timings: 1`). Per request:
status, route, TTFT, end to end. A prompt that falls back was prefilled (in part) twice.

`--baseline-tree DIR` (a `git worktree` of an earlier commit with its `pdserve/v1` stubs and
compiled extensions copied in): the baseline and this checkout run `--rounds` times each,
alternating, on the same machine, so a change in the host's speed shows in both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench import records
from bench.cold_burst import check_tree, cluster_of, git, pct, prompt, write_record
from bench.goodput import machine_info
from pdserve.cluster import LocalCluster
from pdserve.engine.cpu import cpu_summary


async def one(client: httpx.AsyncClient, url: str, text: str, max_tokens: int,
              headers: dict[str, str]) -> dict[str, Any]:
    t0 = time.monotonic()
    body = {"model": "default", "prompt": text, "max_tokens": max_tokens, "temperature": 0}
    out: dict[str, Any] = {"status": None, "route": None, "ttft_s": None, "e2e_s": None,
                           "prompt_tokens": None, "error": None}
    try:
        r = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        out["status"] = r.status_code
        data = r.json()
        if r.status_code != 200:
            out["error"] = data.get("error", {}).get("message")
        else:
            info = data.get("pdserve") or {}
            out["route"] = info.get("route")
            ttft = (info.get("timings_ms") or {}).get("ttft_ms")
            out["ttft_s"] = None if ttft is None else ttft / 1000
            out["prompt_tokens"] = data["usage"]["prompt_tokens"]
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["e2e_s"] = time.monotonic() - t0
    return out


async def drive(cluster: LocalCluster, args: argparse.Namespace, seed: int
                ) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    headers = {**cluster.auth_headers(), "X-Latency-Class": "batch", "X-Pdserve-Timings": "1"}
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for _ in range(args.waves):
            texts = [prompt(rng, args.prompt_tokens) for _ in range(args.per_wave)]
            results += await asyncio.gather(*(one(client, cluster.http_url, t, args.max_tokens,
                                                  headers) for t in texts))
    return results


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == 200]
    routes: dict[str, int] = {}
    for r in ok:
        routes[r["route"] or "?"] = routes.get(r["route"] or "?", 0) + 1
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    e2e = [r["e2e_s"] for r in ok]
    return {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "routes": routes,
            "redone_prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok
                                        if r["route"] == "fallback"),
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "ttft_max_s": max(ttft, default=None),
            "e2e_mean_s": statistics.fmean(e2e) if e2e else None}


def run_system(name: str, args: argparse.Namespace, tree: Path | None, seed: int
               ) -> dict[str, Any]:
    router_args = ("--prefill-timeout", f"{args.lease:g}", "--placement", "threshold")
    with cluster_of(tree, router_args=router_args) as cluster:
        results = asyncio.run(drive(cluster, args, seed))
        versions = check_tree(cluster, tree)
    s = summarize(results)
    print(f"{name:>9}: ok {s['ok']}/{s['requests']}, routes {s['routes']}, redone "
          f"{s['redone_prompt_tokens']} prompt tokens; TTFT p50 {s['ttft_p50_s'] or 0:.1f} s "
          f"p90 {s['ttft_p90_s'] or 0:.1f} s max {s['ttft_max_s'] or 0:.1f} s; e2e mean "
          f"{s['e2e_mean_s'] or 0:.1f} s; load {os.getloadavg()[0]:.2f}", flush=True)
    return {"system": name, "tree": str(tree) if tree else None, "imported_from": versions,
            "seed": seed, "summary": s, "requests": results}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lease_renewal", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lease", type=float, default=4.0,
                    help="the router's --prefill-timeout (s)")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--per-wave", type=int, default=2)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline-tree", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--resummarize", type=Path, default=None, metavar="RECORD",
                    help="only recompute RECORD's summaries from its requests (in place)")
    args = ap.parse_args(argv)
    if args.resummarize:
        rec = records.read_json(args.resummarize)
        for run in rec["runs"]:
            run["summary"] = summarize(run["requests"])
        rec["summaries_recomputed_at"] = git("rev-parse", "HEAD")
        records.write_json(args.resummarize, rec)
        return 0
    rec: dict[str, Any] = {
        "benchmark": "bench.lease_renewal", "args": {k: str(v) for k, v in vars(args).items()},
        "machine": {**machine_info(), "cpu_features": cpu_summary(),
                    "loadavg_start": os.getloadavg()},
        "git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--short")),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    if args.baseline_tree:
        rec["baseline_commit"] = git("rev-parse", "HEAD", cwd=args.baseline_tree)
    for i in range(args.rounds):
        seed = args.seed + i  # both systems get the same prompts in a round
        if args.baseline_tree:
            rec["runs"].append(run_system("baseline", args, args.baseline_tree.resolve(), seed))
        rec["runs"].append(run_system("this", args, None, seed))
    write_record(rec, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
