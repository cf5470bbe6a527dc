"""Interactive prompts behind batch ones, through a live cluster: their time to first token.

    python -m bench.class_mix --router 127.0.0.1:18051 [--batch-concurrency 2] \\
        [--batch-tokens 1100] [--interactive 16] [--interactive-tokens 400] [--gap-s 1.5] \\
        [--out F]

While `--batch-concurrency` closed loops send batch-class prompts of `--batch-tokens` random
token ids (none cached: every one is prefilled in full, remotely if the router so decides),
`--interactive` interactive-class prompts of `--interactive-tokens` random ids arrive one
every `--gap-s`. Each request streams 8 tokens with the `pdserve` client. Reports TTFT per
class and route, and the requests that ended in an error (a refusal) per class. An engine
that serves its running prompts first come, first served makes an interactive prompt that
lands behind a batch prompt's chunks wait for all of them.
Prints one JSON object (and writes it to --out) with the CPU and every request's row.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench import commit_id, emit
from bench.goodput import machine_info
from pdserve.client import RouterClient, RouterError, Sampling
from pdserve.engine.cpu import cpu_summary


async def one(client: RouterClient, label: str, rng: random.Random, tokens: int,
              latency: str) -> dict[str, Any]:
    """One request's row: its route and TTFT, or the error it ended with (a refusal:
    ``RESOURCE_EXHAUSTED (overloaded)``)."""
    ids = [rng.randrange(1000, 40000) for _ in range(tokens)]
    row: dict[str, Any] = {"request": label, "class": latency, "prompt_tokens": tokens}
    sent = time.perf_counter()
    first = None
    route = ""
    try:
        async for chunk in client.generate(token_ids=ids, request_id=label,
                                           sampling=Sampling(max_tokens=8, ignore_eos=True),
                                           latency=latency):  # type: ignore[arg-type]
            if first is None and chunk.token_ids:
                first = time.perf_counter()
            route = chunk.route or route
    except RouterError as exc:
        return {**row, "error": f"{exc.status} ({exc.code})"}
    assert first is not None
    return {**row, "route": route, "ttft_ms": round((first - sent) * 1e3, 1)}


def dist(xs: list[float], digits: int = 1) -> dict[str, float]:
    """n, median, p90 (the value at rank 0.9 n) and max of `xs`, rounded to `digits`."""
    xs = sorted(xs)
    if not xs:
        return {}
    return {"n": len(xs), "p50": round(statistics.median(xs), digits),
            "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], digits),
            "max": round(xs[-1], digits)}


async def run(args: argparse.Namespace, commit: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    done = asyncio.Event()
    async with RouterClient(args.router, timeout_s=300.0) as client:

        async def batch_loop(k: int) -> None:
            n = 0
            while not done.is_set():
                rows.append(await one(client, f"batch-{k}-{n}", random.Random(rng.random()),
                                      args.batch_tokens, "batch"))
                n += 1
                if "error" in rows[-1]:
                    await asyncio.sleep(1.0)  # refused: not a busy loop of refusals

        loops = [asyncio.create_task(batch_loop(k)) for k in range(args.batch_concurrency)]
        await asyncio.sleep(args.gap_s)  # the batch prompts are in the engines first
        fg = []
        for i in range(args.interactive):
            fg.append(asyncio.create_task(one(client, f"interactive-{i}",
                                              random.Random(rng.random()),
                                              args.interactive_tokens, "interactive")))
            await asyncio.sleep(args.gap_s)
        rows += await asyncio.gather(*fg)
        done.set()
        await asyncio.gather(*loops)
    out: dict[str, Any] = {}
    errors: dict[str, int] = {}
    for cls in ("interactive", "batch"):
        served = [r for r in rows if r["class"] == cls and "error" not in r]
        for route in sorted({r["route"] for r in served}):
            out[f"{cls}/{route}"] = dist([r["ttft_ms"] for r in served if r["route"] == route])
        for r in rows:
            if r["class"] == cls and "error" in r:
                key = f"{cls}: {r['error']}"
                errors[key] = errors.get(key, 0) + 1
    return {"bench": "bench/class_mix.py", "config": {k: str(v) for k, v in vars(args).items()},
            "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {**machine_info(), "cpu_summary": cpu_summary()},
            "ttft_ms": out, "errors": errors, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", required=True, help="the router's gRPC address")
    p.add_argument("--batch-concurrency", type=int, default=2)
    p.add_argument("--batch-tokens", type=int, default=1100)
    p.add_argument("--interactive", type=int, default=16)
    p.add_argument("--interactive-tokens", type=int, default=400)
    p.add_argument("--gap-s", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    emit(asyncio.run(run(args, commit_id())), args.out, ("commit", "ttft_ms", "errors"))


if __name__ == "__main__":
    main()
