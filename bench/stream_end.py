"""How long a stream's last token takes, against its other tokens, through a live cluster.

    python -m bench.stream_end --router 127.0.0.1:18051 [--requests 24] [--concurrency 3] \\
        [--prompt-tokens 1100] [--max-tokens 24] [--out F]

Sends `--requests` prompts of `--prompt-tokens` random token ids (none cached: the router
sends them to the prefill pool) with `--concurrency` in flight, so the prefill worker is
mostly computing another prompt when a stream ends, and streams each one with the `pdserve`
client. Per request: the gaps between the chunks it received; the last one (to the final
chunk) against the median of the others. The router used to hold a remote stream's last
token until the prefill worker's reply came (its stage timings), and that reply waited for
the prefill engine to free the prompt's blocks, behind whatever step it was running.
Prints one JSON object (and writes it to --out) with the CPU's flags and each request's row.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench import commit_id, emit
from bench.class_mix import dist
from bench.goodput import machine_info
from pdserve.client import RouterClient, Sampling
from pdserve.engine.cpu import cpu_summary


async def one(client: RouterClient, i: int, rng: random.Random, prompt_tokens: int,
              max_tokens: int) -> dict[str, Any]:
    ids = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
    sent = time.perf_counter()
    times: list[float] = []
    route = ""
    async for chunk in client.generate(token_ids=ids, request_id=f"end-{i}",
                                       sampling=Sampling(max_tokens=max_tokens,
                                                         temperature=0.0, ignore_eos=True),
                                       latency="batch"):
        if chunk.token_ids or chunk.finish_reason:
            times.append(time.perf_counter())
        route = chunk.route or route
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
    return {"request": i, "route": route, "tokens": len(times),
            "ttft_ms": round((times[0] - sent) * 1e3, 2) if times else None,
            "last_gap_ms": round(gaps[-1], 2) if gaps else None,
            "median_gap_ms": round(statistics.median(gaps[:-1]), 2) if len(gaps) > 1 else None}


async def run(args: argparse.Namespace, commit: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.concurrency)
    async with RouterClient(args.router, timeout_s=300.0) as client:

        async def limited(i: int) -> dict[str, Any]:
            async with sem:
                return await one(client, i, random.Random(rng.random()), args.prompt_tokens,
                                 args.max_tokens)

        rows = await asyncio.gather(*(limited(i) for i in range(args.requests)))
    remote = [r for r in rows if r["route"] == "remote" and r["median_gap_ms"]]
    return {
        "bench": "bench/stream_end.py", "config": vars(args),
        "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine_info(), "cpu_summary": cpu_summary()},
        "remote": {
            "last_gap_ms": dist([r["last_gap_ms"] for r in remote], 2),
            "median_gap_ms": dist([r["median_gap_ms"] for r in remote], 2),
            "last_over_median": dist([r["last_gap_ms"] / r["median_gap_ms"]
                                      for r in remote], 2),
        },
        "routes": {k: sum(r["route"] == k for r in rows) for k in {r["route"] for r in rows}},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", required=True, help="the router's gRPC address")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1100)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    emit(asyncio.run(run(args, commit_id())), args.out, ("commit", "routes", "remote"))

if __name__ == "__main__":
    main()
