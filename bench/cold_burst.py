"""A burst on a cold cluster: what admission control admits, and whether it keeps its word.

    python -m bench.cold_burst --out docs/bench/cold_burst.json [--baseline-tree DIR]

Starts the cluster as `pdserve cluster up --prefill 1 --decode 1` does (`LocalCluster`: a
private redis-server, the default model, admission on with its default deadlines), then at
once sends `--requests` (64) streamed completions of ~`--prompt-tokens` (500) tokens each,
every prompt different (no prefix-cache hits), `X-Latency-Class: standard` (deadline 30 s),
`--max-tokens` (16) greedy tokens, before any request has finished: the router has no first
token to learn from, only the workers' heartbeats. Per request: HTTP status, time to the
first streamed token, end to end. Summary: admitted / refused (429 + Retry-After) / errors;
of the admitted, TTFT p50 / p90 / max and how many got their first token within the
deadline.

`--baseline-tree DIR`: first the same burst against the code in DIR (e.g. a `git worktree`
of an earlier commit, with its `pdserve/v1` stubs copied in), put first on PYTHONPATH for
every process of that cluster, then against this checkout; the two runs share the machine,
not their time. Writes the JSON record (`--out`) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from pdserve.cluster import LocalCluster

WORDS = ("river stone lantern orchard silver market winter signal harbor copper meadow "
         "engine paper garden thunder valley candle mirror forest station ribbon castle "
         "planet shadow anchor velvet canyon bridge marble feather").split()


def prompt(rng: random.Random, tokens: int) -> str:
    # ~1 token a word for these words with SmolLM2's tokenizer (the record keeps the real
    # count from the response's usage).
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


async def one(client: httpx.AsyncClient, url: str, text: str, max_tokens: int,
              headers: dict[str, str]) -> dict[str, Any]:
    t0 = time.monotonic()
    body = {"model": "default", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    out: dict[str, Any] = {"status": None, "ttft_s": None, "e2e_s": None,
                           "prompt_tokens": None, "retry_after": None, "error": None}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers=headers) as r:
            out["status"] = r.status_code
            out["retry_after"] = r.headers.get("retry-after")
            if r.status_code != 200:
                out["error"] = (await r.aread()).decode(errors="replace")[:300]
                out["e2e_s"] = time.monotonic() - t0
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                if out["ttft_s"] is None and chunk.get("choices") and \
                        chunk["choices"][0].get("text"):
                    out["ttft_s"] = time.monotonic() - t0
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["e2e_s"] = time.monotonic() - t0
    return out


def pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summarize(results: list[dict[str, Any]], deadline_s: float) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == 200 and r["ttft_s"] is not None]
    ttft = [r["ttft_s"] for r in ok]
    return {
        "requests": len(results), "admitted": len(ok),
        "refused_429": sum(1 for r in results if r["status"] == 429),
        "refused_with_retry_after": sum(1 for r in results
                                        if r["status"] == 429 and r["retry_after"]),
        "errors": sum(1 for r in results if r["status"] not in (200, 429) or
                      (r["status"] == 200 and r["ttft_s"] is None)),
        "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
        "ttft_max_s": max(ttft) if ttft else None,
        "admitted_within_deadline": sum(1 for t in ttft if t <= deadline_s),
        "mean_prompt_tokens": (sum(r["prompt_tokens"] for r in ok if r["prompt_tokens"])
                               / max(1, sum(1 for r in ok if r["prompt_tokens"]))),
        "wall_s": max((r["e2e_s"] or 0.0) for r in results),
    }


async def burst(cluster: LocalCluster, args: argparse.Namespace, seed: int
                ) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    texts = [prompt(rng, args.prompt_tokens) for _ in range(args.requests)]
    headers = {**cluster.auth_headers(), "X-Latency-Class": "standard"}
    limits = httpx.Limits(max_connections=args.requests + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        return await asyncio.gather(*(one(client, cluster.http_url, t, args.max_tokens,
                                          headers) for t in texts))


@contextlib.contextmanager
def cluster_of(tree: Path | None, **kw: Any) -> Iterator[LocalCluster]:
    """A 1P1D `LocalCluster` (`kw`: more of its arguments) whose processes run the code in
    `tree` (None: this checkout)."""
    env = {"PYTHONPATH": str(tree)} if tree else {}
    # `python -m` puts the working directory first on sys.path: the baseline's processes
    # start from an empty one, or they would import this checkout instead of `tree`.
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as empty:
        if tree:
            os.chdir(empty)
        try:
            with LocalCluster(prefill=1, decode=1, env=env, **kw) as cluster:
                yield cluster
        finally:
            os.chdir(here)


def write_record(rec: dict[str, Any], out: Path | None) -> None:
    rec["machine"]["loadavg_end"] = os.getloadavg()
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"wrote {out}")


def run_system(name: str, args: argparse.Namespace, tree: Path | None) -> dict[str, Any]:
    with cluster_of(tree) as cluster:
        results = asyncio.run(burst(cluster, args, args.seed))
        versions = check_tree(cluster, tree)
    summary = summarize(results, args.deadline_s)
    print(f"{name:>9}: admitted {summary['admitted']}/{summary['requests']}, "
          f"429 {summary['refused_429']}, errors {summary['errors']}; TTFT p50 "
          f"{summary['ttft_p50_s'] or 0:.1f} s p90 {summary['ttft_p90_s'] or 0:.1f} s max "
          f"{summary['ttft_max_s'] or 0:.1f} s; {summary['admitted_within_deadline']} "
          f"within {args.deadline_s:g} s", flush=True)
    return {"system": name, "tree": str(tree) if tree else None, "imported_from": versions,
            "summary": summary, "requests": results}


def check_tree(cluster: LocalCluster, tree: Path | None) -> str:
    """Where the router process imported `router.admission` from (its log's first lines do
    not say): asked of a Python started exactly as the cluster's children are."""
    env = dict(cluster.env)
    out = subprocess.run([sys.executable, "-c", "import router.admission as a; print(a.__file__)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    if tree and not out.startswith(str(tree)):
        raise SystemExit(f"the baseline imported {out}, not {tree}")
    return out


def git(*argv: str, cwd: Path | None = None) -> str:
    return subprocess.run(["git", *argv], capture_output=True, text=True, check=False,
                          cwd=cwd).stdout.strip()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cold_burst", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=30.0,
                    help="the standard class's TTFT deadline the router runs with")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline-tree", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    rec: dict[str, Any] = {
        "benchmark": "bench.cold_burst", "args": {k: str(v) for k, v in vars(args).items()},
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "cpu_flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_vnni",
                                                          "avx512_bf16")},
                    "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
        "git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--short")),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    if args.baseline_tree:
        rec["baseline_commit"] = git("rev-parse", "HEAD", cwd=args.baseline_tree)
        rec["runs"].append(run_system("baseline", args, args.baseline_tree.resolve()))
    rec["runs"].append(run_system("this", args, None))
    write_record(rec, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
