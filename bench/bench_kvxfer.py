"""KV transfer throughput between two processes, next to raw memcpy and raw UCX.

    python bench/bench_kvxfer.py [--mb 64] [--iters 10]

A receiver process owns a destination pool (KVReceiver) and a raw ucxx listener; this
process sends 64 MB of KV blocks to it three ways and prints GB/s:

- memcpy:            torch copy of 64 MB inside one process (the ceiling for host memory)
- raw ucxx:          one 64 MB ucxx tag send + 1-byte ack, same two processes
- kvxfer contiguous: KVSender.send of 64 MB as one block run (header, accept, data, done)
- kvxfer scattered:  the same blocks at shuffled ids, so every block is its own run

Reading the numbers: endpoints made through a ucxx listener always ask UCX for peer-failure
error handling, and on one host UCX then only offers tcp/lo (the shared-memory transports
do not support it by default), so "raw ucxx" is the ceiling kvxfer can reach here.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# Runnable as a plain script; the UCX setting must precede ucxx's import to silence a warning.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import numpy as np
import structlog
import torch

from kvxfer import KVReceiver, KVSender
from pdserve.control import KVDescriptor
from pdserve.types import KVLayout

# 512 KiB blocks, a realistic size (8 layers x K/V x 16 tokens x 8 heads x 128 dims, fp16).
BLOCK = dict(num_layers=8, block_size=16, num_kv_heads=8, head_dim=128, dtype="float16")
DESC_ID = "bench-decode:1"
ACK_TAG = 2
DATA_TAG = 1


def layout_for(nbytes: int) -> tuple[KVLayout, int]:
    probe = KVLayout(num_blocks=1, model_id="bench", **BLOCK)  # type: ignore[arg-type]
    nblocks = nbytes // probe.block_nbytes
    return KVLayout(num_blocks=2 * nblocks, model_id="bench", **BLOCK), nblocks  # type: ignore[arg-type]


# --------------------------------------------------------------------------- receiver process


def quiet_logs() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def receiver_main(conn: Connection, nbytes: int) -> None:
    quiet_logs()
    torch.set_num_threads(1)
    asyncio.run(_receiver(conn, nbytes))


async def _receiver(conn: Connection, nbytes: int) -> None:
    import ucxx

    layout, _ = layout_for(nbytes)
    pool = torch.zeros(layout.shape, dtype=torch.float16)
    raw_buf = np.empty(nbytes, dtype=np.uint8)

    async def raw_handler(ep: Any) -> None:
        try:
            while True:
                await ep.recv(raw_buf, tag=DATA_TAG)
                await ep.send(np.ones(1, np.uint8), tag=ACK_TAG)
        except ucxx.exceptions.UCXError:
            return

    raw = ucxx.create_listener(raw_handler, port=0)
    async with KVReceiver(pool, layout, DESC_ID) as rx:
        conn.send((rx.address, raw.port))
        while True:
            cmd = await asyncio.to_thread(conn.recv)
            if cmd is None:
                break
            transfer_ids, dst_blocks = cmd
            waits = [rx.expect(t, dst_blocks, timeout_s=120) for t in transfer_ids]
            conn.send("ready")
            await asyncio.gather(*waits)
            conn.send("done")
    raw.close()


# --------------------------------------------------------------------------- sender side


def bench_memcpy(nbytes: int, iters: int) -> list[float]:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return times


async def bench_raw(port: int, nbytes: int, iters: int) -> list[float]:
    import ucxx

    ep = await ucxx.create_endpoint("127.0.0.1", port)
    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    ack = np.empty(1, np.uint8)
    times = []
    for i in range(iters + 2):
        start = time.perf_counter()
        await asyncio.wait_for(ep.send(buf, tag=DATA_TAG), 60)
        await asyncio.wait_for(ep.recv(ack, tag=ACK_TAG), 60)
        if i >= 2:  # the first sends set up the transports
            times.append(time.perf_counter() - start)
    ep.abort()
    return times


async def bench_kvxfer(
    conn: Connection, address: str, nbytes: int, iters: int, scattered: bool
) -> list[float]:
    layout, nblocks = layout_for(nbytes)
    src_pool = torch.randn(layout.shape, dtype=torch.float32).to(torch.float16)
    rng = np.random.default_rng(1)
    if scattered:  # no two neighbours stay neighbours on both sides: one run per block
        src_ids = rng.permutation(layout.num_blocks)[:nblocks].tolist()
        dst_ids = rng.permutation(layout.num_blocks)[:nblocks].tolist()
    else:
        src_ids = list(range(nblocks))
        dst_ids = list(range(nblocks, 2 * nblocks))
    desc = KVDescriptor(DESC_ID, "bench-decode", 1, address, layout)

    async def resolve(_: str) -> KVDescriptor:
        return desc

    tag = "s" if scattered else "c"
    ids = [f"{tag}{i}" for i in range(iters + 2)]
    conn.send((ids, dst_ids))
    assert await asyncio.to_thread(conn.recv) == "ready"
    times = []
    async with KVSender(layout, resolve) as tx:
        await tx.warmup(descriptor_id=DESC_ID)
        for i, transfer_id in enumerate(ids):
            start = time.perf_counter()
            result = await tx.send(DESC_ID, src_pool, src_ids, dst_ids, transfer_id, 60)
            if i >= 2:
                times.append(time.perf_counter() - start)
    assert await asyncio.to_thread(conn.recv) == "done"
    if scattered:
        assert result.num_runs > nblocks // 2, result.num_runs
    return times


async def run(nbytes: int, iters: int) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, nbytes), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("receiver process did not start")
        address, raw_port = parent.recv()
        results = {
            "memcpy (torch, 1 process)": bench_memcpy(nbytes, iters),
            "raw ucxx send (1 buffer)": await bench_raw(raw_port, nbytes, iters),
            "kvxfer contiguous (1 run)": await bench_kvxfer(parent, address, nbytes, iters, False),
            "kvxfer scattered": await bench_kvxfer(parent, address, nbytes, iters, True),
        }
        parent.send(None)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    report(results, nbytes)


def report(results: dict[str, list[float]], nbytes: int) -> None:
    layout, nblocks = layout_for(nbytes)
    memcpy = nbytes / statistics.median(results["memcpy (torch, 1 process)"]) / 1e9
    raw = nbytes / statistics.median(results["raw ucxx send (1 buffer)"]) / 1e9
    print(
        f"\n{nbytes / 2**20:.0f} MiB = {nblocks} blocks x {layout.block_nbytes // 1024} KiB, "
        f"median of {len(next(iter(results.values())))} runs, host memory, "
        f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}\n"
    )
    print(f"{'method':<28} {'GB/s':>8} {'ms':>8} {'vs memcpy':>10} {'vs raw ucxx':>12}")
    for name, times in results.items():
        med = statistics.median(times)
        gbps = nbytes / med / 1e9
        print(
            f"{name:<28} {gbps:>8.2f} {med * 1e3:>8.2f} {gbps / memcpy:>10.2f} {gbps / raw:>12.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="MiB per transfer")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    asyncio.run(run(args.mb << 20, args.iters))


if __name__ == "__main__":
    main()
