"""What TLS on every hop costs (issue 21 item 2): the same 1P1D cluster with and without it.

    python -m bench.tls_cost [--rounds 3] [--out docs/bench/tls_cost.json]

Two `LocalCluster`s run side by side for the whole measurement, both with a cluster secret
and an API key; one plaintext, one started as `pdserve cluster up --tls` starts it (private
CA, TLS on the router's gRPC API and HTTPS gateway, mTLS router -> workers). Rounds
alternate between them (plain first, then TLS first, ...), so background load on the
machine falls on both alike. Each round, on each cluster:

- `grpc_c1`: `--requests` greedy streams one after another through the router's gRPC API
  (pdserve.client, one channel kept open), prompts of `--prompt-tokens` random ids (a
  different prompt each request, so no prefix cache hit; above the remote threshold: router
  -> decode AllocateAndGenerate, router -> prefill Prefill, both on mTLS channels),
  `--tokens` output tokens with ignore_eos;
- `grpc_c4`: 4 such streams at once;
- `rest_c1`: the same as `grpc_c1` over the OpenAI `/v1/completions` SSE stream (HTTPS, one
  connection kept alive);
- `connect`: a new gRPC channel to the router until ready (TCP, plus the TLS handshake).

TTFT is the client's (request sent -> first token), TPOT the median gap between a stream's
tokens (first excluded); p50 over every request of every round. Both clusters get the same
prompts in the same order, and their greedy tokens are compared (`tokens_identical`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

API_KEY = "sk-bench-tls-cost-0123456789abcdef"
SECRET = "bench-tls-cost-cluster-secret-0123456789abcdef"


def _prompt(i: int, n: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _gaps_ms(stamps: list[float]) -> float:
    gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]
    return statistics.median(gaps) * 1000


async def _grpc_stream(client: Any, ids: list[int], tokens: int
                       ) -> tuple[float, float, list[int]] | None:
    """(TTFT ms, TPOT ms, tokens), or None when the router refused or failed the request (a
    machine this loaded can lose a worker's lease; such requests are counted, not timed)."""
    from pdserve.client import RouterError, Sampling

    out: list[int] = []
    started = time.perf_counter()
    stamps = [started]
    try:
        async for chunk in client.generate(token_ids=ids, sampling=Sampling(
                max_tokens=tokens, ignore_eos=True)):
            if chunk.token_ids:
                stamps.append(time.perf_counter())
                out.extend(chunk.token_ids)
    except RouterError as exc:
        print(f"request failed: {exc}", file=sys.stderr)
        return None
    return (stamps[1] - started) * 1000, _gaps_ms(stamps), out


async def _grpc_round(cluster: Any, prompts: list[list[int]], tokens: int,
                      ) -> dict[str, Any]:
    from pdserve.client import RouterClient

    creds = cluster.grpc_credentials()
    res: dict[str, Any] = {"grpc_c1": [], "grpc_c4": [], "tokens": {}, "failed": 0}

    def keep(kind: str, i: int, done: tuple[float, float, list[int]] | None) -> None:
        if done is None:
            res["failed"] += 1
            return
        res[kind].append(done[:2])
        res["tokens"][i] = done[2]

    async with RouterClient(cluster.grpc_address, api_key=API_KEY, credentials=creds) as c:
        await _grpc_stream(c, prompts[0][:8], 2)  # the channel is up before timing
        for i in range(1, len(prompts) - 4):
            keep("grpc_c1", i, await _grpc_stream(c, prompts[i], tokens))
        together = await asyncio.gather(*(_grpc_stream(c, prompts[i], tokens)
                                          for i in range(len(prompts) - 4, len(prompts))))
        for i, done in zip(range(len(prompts) - 4, len(prompts)), together, strict=True):
            keep("grpc_c4", i, done)
    return res


async def _connect(cluster: Any, n: int) -> list[float]:
    import grpc

    creds = cluster.grpc_credentials()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        channel = (grpc.aio.insecure_channel(cluster.grpc_address) if creds is None else
                   grpc.aio.secure_channel(cluster.grpc_address, creds))
        async with channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            times.append((time.perf_counter() - started) * 1000)
    return times


def _rest_round(cluster: Any, prompts: list[list[int]], tokens: int
                ) -> tuple[list[tuple[float, float]], int]:
    """(TTFT, TPOT) of each answered request, and how many failed."""
    import httpx

    out, failed = [], 0
    with httpx.Client(base_url=cluster.http_url, verify=cluster.http_verify(), timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        http.get("/health").raise_for_status()  # connected before timing
        for ids in prompts:
            started = time.perf_counter()
            stamps = [started]
            with http.stream("POST", "/v1/completions", json={
                    "prompt": ids, "max_tokens": tokens, "stream": True, "ignore_eos": True,
                    "temperature": 0}) as r:
                if r.status_code != 200:
                    r.read()
                    print(f"request failed: HTTP {r.status_code} {r.text}", file=sys.stderr)
                    failed += 1
                    continue
                for line in r.iter_lines():
                    if line.startswith("data:") and "[DONE]" not in line:
                        stamps.append(time.perf_counter())
            out.append(((stamps[1] - started) * 1000, _gaps_ms(stamps)))
    return out, failed


def _p(values: list[float], q: int) -> float:
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1]
                 if len(values) > 1 else values[0], 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4, help="c=1 requests per round")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from pdserve.cluster import LocalCluster
    from pdserve.engine import model_store
    from pdserve.engine.cpu import cpu_summary

    model = str(model_store.resolve_model(None))
    started = time.time()
    clusters: dict[str, LocalCluster] = {}
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {
        m: defaultdict(list) for m in ("plain", "tls")}
    connect: dict[str, list[float]] = {"plain": [], "tls": []}
    tokens: dict[str, dict[tuple[int, int], list[int]]] = {"plain": {}, "tls": {}}
    failed = {"plain": 0, "tls": 0}
    try:
        for mode in ("plain", "tls"):
            c = clusters[mode] = LocalCluster(
                prefill=1, decode=1, model=model, cluster_secret=SECRET, tls=mode == "tls",
                env={"PDSERVE_API_KEY": API_KEY}, extra_worker_args=("--kv-cache-mb", "256"),
                router_args=("--no-admission",))  # latency is measured, not admission
            c.start(timeout_s=900)
            print(f"{mode} cluster up ({time.time() - started:.0f} s)", file=sys.stderr)
        per_round = args.requests + 1 + 4 + args.requests
        for r in range(args.rounds):
            base = 1 + r * per_round
            prompts = [_prompt(base + i, args.prompt_tokens) for i in range(per_round)]
            grpc_prompts, rest_prompts = prompts[:args.requests + 5], prompts[args.requests + 5:]
            for mode in (("plain", "tls") if r % 2 == 0 else ("tls", "plain")):
                c = clusters[mode]
                res = asyncio.run(_grpc_round(c, grpc_prompts, args.tokens))
                samples[mode]["grpc_c1"] += res["grpc_c1"]
                samples[mode]["grpc_c4"] += res["grpc_c4"]
                tokens[mode].update({(r, i): t for i, t in res["tokens"].items()})
                rest, rest_failed = _rest_round(c, rest_prompts, args.tokens)
                samples[mode]["rest_c1"] += rest
                failed[mode] += res["failed"] + rest_failed
                connect[mode] += asyncio.run(_connect(c, 10))
            print(f"round {r + 1}/{args.rounds} done ({time.time() - started:.0f} s)",
                  file=sys.stderr)
    finally:
        for c in clusters.values():
            c.close()

    results: dict[str, dict[str, Any]] = {}
    for mode in ("plain", "tls"):
        results[mode] = {
            name: {"ttft_ms_p50": _p([t for t, _ in s], 50),
                   "ttft_ms_p90": _p([t for t, _ in s], 90),
                   "tpot_ms_p50": _p([p for _, p in s], 50), "n": len(s)}
            for name, s in samples[mode].items()}
        results[mode]["connect"] = {"ms_p50": _p(connect[mode], 50), "n": len(connect[mode])}
    ratio = {name: {k: round(v / results["plain"][name][k], 3)
                    for k, v in metrics.items() if k != "n" and results["plain"][name][k]}
             for name, metrics in results["tls"].items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    record = {
        "benchmark": "bench.tls_cost", "commit": commit, "dirty": dirty,
        "machine": {"cpu": cpu_summary(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "config": {"cluster": "1P1D, cluster secret + API key, both clusters up throughout, "
                   "rounds alternate", "rounds": args.rounds, "requests_c1": args.requests,
                   "prompt_tokens": args.prompt_tokens, "output_tokens": args.tokens,
                   "route": "remote (prompt above the 256-token threshold)",
                   "tls": "EC P-256 certificates from `pdserve certs` (LocalCluster tls=True)"},
        "results": results,
        "ratio_tls_to_plain": ratio,
        "failed_requests": failed,
        # Greedy tokens of every gRPC request answered in both runs.
        "tokens_compared": len(both := tokens["plain"].keys() & tokens["tls"].keys()),
        "tokens_identical": all(tokens["plain"][k] == tokens["tls"][k] for k in both),
        "total_s": round(time.time() - started, 1),
    }
    print(f"CPU: {cpu_summary()}")
    for name in results["plain"]:
        p, t = results["plain"][name], results["tls"][name]
        print(f"{name:>8}: " + ", ".join(f"{k} {p[k]} -> {t[k]} ({ratio[name][k]:.2f}x)"
                                         for k in p if k in ratio[name]))
    print(f"greedy tokens identical with and without TLS: {record['tokens_identical']} "
          f"({record['tokens_compared']} requests); failed: {failed}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if record["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
