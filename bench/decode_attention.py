"""Batched paged decode attention against the machine's read bandwidth (issue 20, item 2).

    python -m bench.decode_attention [--rounds 9] [--out docs/bench/decode_attention.json]

Times the extension's `paged_decode_attention` over every layer of SmolLM2-135M's shape (30
layers, 9 query heads over 3 KV heads of 64) for batches of decode sequences whose blocks lie
scattered through a huge-page pool as the engine's does (`kv_pool_tensor`), with the kernel's
prefetch of the next task's K and V on and off, at 16- and 64-token blocks. Each case's
variants and a `sum()` over 512 MB (what a streaming read reaches here) alternate, round by
round, so all see the same machine; it prints the median time, the KV bytes read per second
and that as a share of the `sum()` bandwidth, and checks that prefetch changes no bit.

`--against REV` also builds REV's kernels/cpu_ops.cpp (same flags, a temporary directory) and
times it, prefetch off and on, in the same rounds: a before/after from one run, with the bits
of both compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench import build_at, commit_id
from pdserve.engine.cpu import cpu_summary
from pdserve.engine.kernels import cpu_extension
from pdserve.engine.model_runner import kv_pool_tensor
from pdserve.kv_layout import KVLayout

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
CASES = ((16, 233), (64, 233), (1, 1000), (4, 4000))  # (batch, context): 1-2 spans, 8 spans


def _seconds(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_case(ext: Any, batch: int, context: int, block: int, rounds: int,
             sum_buf: torch.Tensor, against: Any = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(batch * 7919 + context)
    nb = -(-context // block)
    pool = kv_pool_tensor((batch * nb + 8, LAYERS, 2, block, KV_HEADS, HEAD_DIM),
                          torch.float32, torch.device("cpu"))
    pool.normal_(generator=g)
    tables = torch.randperm(pool.shape[0], generator=g)[: batch * nb].view(batch, nb)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
    scale = HEAD_DIM**-0.5

    def step(prefetch: bool, kernels: Any = ext) -> list[torch.Tensor]:
        return [kernels.paged_decode_attention(q, pool[:, i], tables, lens, scale, prefetch)
                for i in range(LAYERS)]

    identical = all(torch.equal(a, b) for a, b in zip(step(True), step(False), strict=True))
    variants = {"prefetch_off": (False, ext), "prefetch_on": (True, ext)}
    if against is not None:
        variants |= {"against_off": (False, against), "against_on": (True, against)}
        identical = identical and all(torch.equal(a, b) for a, b in zip(
            step(False), step(True, against), strict=True))
    times: dict[str, list[float]] = {name: [] for name in (*variants, "sum")}
    for _ in range(rounds):
        for name, (prefetch, kernels) in variants.items():
            times[name].append(_seconds(lambda p=prefetch, k=kernels: step(p, k)))
        times["sum"].append(_seconds(sum_buf.sum))
    kv_bytes = batch * context * KVLayout(1, LAYERS, 1, KV_HEADS, HEAD_DIM, "float32",
                                          "").block_nbytes
    sum_gbs = sum_buf.numel() * 4 / statistics.median(times["sum"]) / 1e9
    row: dict[str, Any] = {"batch": batch, "context": context, "block_size": block,
                           "kv_bytes": kv_bytes, "identical": identical,
                           "sum_gb_per_s": round(sum_gbs, 2), "times_s": times}
    for name in variants:
        med = statistics.median(times[name])
        row[name] = {"ms": round(med * 1e3, 2), "gb_per_s": round(kv_bytes / med / 1e9, 2),
                     "of_sum": round(kv_bytes / med / 1e9 / sum_gbs, 3)}
    row["on_over_off"] = round(row["prefetch_on"]["ms"] / row["prefetch_off"]["ms"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--blocks", default="16,64", help="block sizes (tokens)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--against", metavar="REV",
                        help="also time this git revision's kernel in the same rounds")
    args = parser.parse_args()
    ext = cpu_extension()
    if ext is None:
        raise SystemExit("the CPU extension is unavailable here: nothing to measure")
    against = build_at(args.against) if args.against else None
    sum_buf = torch.ones(512 << 18)
    print(f"CPU: {cpu_summary()}; torch threads {torch.get_num_threads()}")
    print("\n| block | batch | context | prefetch off ms (GB/s, of sum) | prefetch on ms (GB/s, "
          "of sum) | on / off | sum() GB/s | same bits |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for block in (int(b) for b in args.blocks.split(",")):
        for batch, context in CASES:
            r = run_case(ext, batch, context, block, args.rounds, sum_buf, against)
            rows.append(r)
            off, on = r["prefetch_off"], r["prefetch_on"]
            print(f"| {block} | {batch} | {context} | {off['ms']:.1f} ({off['gb_per_s']:.1f}, "
                  f"{off['of_sum']:.2f}) | {on['ms']:.1f} ({on['gb_per_s']:.1f}, "
                  f"{on['of_sum']:.2f}) | {r['on_over_off']:.2f}x | {r['sum_gb_per_s']:.1f} | "
                  f"{r['identical']} |", flush=True)
    if against is not None:
        print(f"\nThe same rounds, {args.against}'s kernel (against) and this one's:\n")
        print("| block | batch | context | against off ms | against on ms | this, off | "
              "this, on | this best / against best |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            ms = {k: r[k]["ms"] for k in ("against_off", "against_on", "prefetch_off",
                                          "prefetch_on")}
            ratio = min(ms["prefetch_off"], ms["prefetch_on"]) / min(ms["against_off"],
                                                                    ms["against_on"])
            r["best_over_against_best"] = round(ratio, 3)
            print(f"| {r['block_size']} | {r['batch']} | {r['context']} | " + " | ".join(
                f"{v:.1f}" for v in ms.values()) + f" | {ratio:.2f}x |")
    record = {
        "bench": "bench.decode_attention", "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit_id(),
        "cpu": cpu_summary(), "threads": torch.get_num_threads(), "load_avg": os.getloadavg(),
        "rounds": args.rounds, "against": args.against, "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
