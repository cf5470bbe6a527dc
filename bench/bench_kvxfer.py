"""KV transfer throughput between two processes, next to raw memcpy and raw UCX.

    python bench/bench_kvxfer.py [--mb 64] [--iters 10] [--sizes 1,8,64] [--json out.json]

A receiver process owns a destination pool (KVReceiver) and a raw ucxx listener; this
process sends 64 MB of KV blocks to it three ways and prints GB/s:

- memcpy:            torch copy of 64 MB inside one process (the ceiling for host memory)
- raw ucxx:          one 64 MB ucxx tag send + 1-byte ack, same two processes
- kvxfer contiguous: KVSender.send of 64 MB as one block run (header, accept, data, done)
- kvxfer scattered:  the same blocks at shuffled ids, so every block is its own run

Each kvxfer row runs twice, alternating transfer by transfer: without digests
(`KVSender(integrity=False)`) and with them (the default: the sender hashes every run with
BLAKE3 before its request, the receiver hashes each run as it lands), so their difference is
the integrity check's cost. Hash rows: BLAKE3 and hashlib's BLAKE2b-256 of the same bytes in
this process, one core. `--json` writes every timing, the git commit and the CPU.

Reading the numbers: endpoints made through a ucxx listener always ask UCX for peer-failure
error handling, and on one host UCX then only offers tcp/lo (the shared-memory transports
do not support it by default), so "raw ucxx" is the ceiling kvxfer can reach here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from pdserve.kv_layout import KVLayout

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
    async with KVReceiver(pool, layout, DESC_ID, shm=False) as rx:  # UCX, not kvxfer.cma
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


def bench_hash(nbytes: int, iters: int) -> dict[str, list[float]]:
    import hashlib

    from kvxfer.pool import digest

    buf = np.random.default_rng(2).integers(0, 255, nbytes, dtype=np.uint8)
    times: dict[str, list[float]] = {"hash: blake3 (1 core)": [],
                                     "hash: blake2b-256 (1 core)": []}
    for _ in range(iters):
        start = time.perf_counter()
        digest(buf)
        times["hash: blake3 (1 core)"].append(time.perf_counter() - start)
        start = time.perf_counter()
        hashlib.blake2b(buf.data, digest_size=32).digest()
        times["hash: blake2b-256 (1 core)"].append(time.perf_counter() - start)
    return times


async def bench_kvxfer(
    conn: Connection, address: str, nbytes: int, iters: int, scattered: bool
) -> dict[str, list[float]]:
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

    name = "kvxfer scattered" if scattered else "kvxfer contiguous (1 run)"
    ids = [f"{name[7]}{i}" for i in range(2 * (iters + 2))]
    conn.send((ids, dst_ids))
    assert await asyncio.to_thread(conn.recv) == "ready"
    times: dict[str, list[float]] = {name: [], f"{name} + digests": []}
    async with KVSender(layout, resolve, integrity=False) as plain, \
            KVSender(layout, resolve) as hashed:
        await plain.warmup(descriptor_id=DESC_ID)
        await hashed.warmup(descriptor_id=DESC_ID)
        for i, transfer_id in enumerate(ids):  # alternate, so drift hits both alike
            tx, key = (plain, name) if i % 2 == 0 else (hashed, f"{name} + digests")
            start = time.perf_counter()
            result = await tx.send(DESC_ID, src_pool, src_ids, dst_ids, transfer_id, 60)
            if i >= 4:
                times[key].append(time.perf_counter() - start)
    assert await asyncio.to_thread(conn.recv) == "done"
    if scattered:
        assert result.num_runs > nblocks // 2, result.num_runs
    return times


async def run(nbytes: int, iters: int) -> dict[str, list[float]]:
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
            **await bench_kvxfer(parent, address, nbytes, iters, False),
            **await bench_kvxfer(parent, address, nbytes, iters, True),
            **bench_hash(nbytes, iters),
        }
        parent.send(None)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    report(results, nbytes)
    return results


def report(results: dict[str, list[float]], nbytes: int) -> None:
    layout, nblocks = layout_for(nbytes)
    memcpy = nbytes / statistics.median(results["memcpy (torch, 1 process)"]) / 1e9
    raw = nbytes / statistics.median(results["raw ucxx send (1 buffer)"]) / 1e9
    print(
        f"\n{nbytes / 2**20:.0f} MiB = {nblocks} blocks x {layout.block_nbytes // 1024} KiB, "
        f"median of {len(next(iter(results.values())))} runs, host memory, "
        f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}\n"
    )
    print(f"{'method':<38} {'GB/s':>8} {'ms':>8} {'vs memcpy':>10} {'vs raw ucxx':>12}")
    for name, times in results.items():
        med = statistics.median(times)
        gbps = nbytes / med / 1e9
        print(
            f"{name:<38} {gbps:>8.2f} {med * 1e3:>8.2f} {gbps / memcpy:>10.2f} {gbps / raw:>12.2f}"
        )
    for name, (extra, base) in digest_cost(results).items():
        print(f"digests cost on {name}: {extra * 1e3:+.2f} ms ({extra / base * 100:+.1f} %; "
              "median of the paired differences)")


def digest_cost(results: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """Per kvxfer row: (median over pairs of the with-digests minus the plain transfer that
    ran just before it, median plain time). Pairing cancels the drift of a busy machine."""
    out = {}
    for name in ("kvxfer contiguous (1 run)", "kvxfer scattered"):
        plain, hashed = results[name], results[f"{name} + digests"]
        out[name] = (statistics.median(h - p for p, h in zip(plain, hashed, strict=True)),
                     statistics.median(plain))
    return out


def machine() -> dict[str, Any]:
    """What the numbers were measured on: commit, CPU, its flags that matter for hashing."""
    import platform
    import subprocess

    import blake3
    import ucxx

    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                  if ln.startswith("model name")), platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in cpu.splitlines()
                  if ln.startswith("flags")), [])
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              check=False).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty_files": git("status", "--porcelain", "--", "kvxfer", "bench/bench_kvxfer.py"),
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "sse4", "sha")) or
                            f in ("ssse3", "bmi2")),
        "loadavg_before": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ucxx": ucxx.__version__,
        "blake3": blake3.__version__,
        "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="MiB per transfer")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sizes", default="", help="MiB per transfer, comma-separated "
                        "(overrides --mb), e.g. 1,8,64")
    parser.add_argument("--json", type=Path, help="write the raw record here")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over every size")
    args = parser.parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [args.mb]
    record: dict[str, Any] = {"bench": "bench/bench_kvxfer.py", "iters": args.iters,
                              "machine": machine(), "rounds": []}
    for _ in range(args.repeat):
        sizes_out: dict[str, Any] = {}
        for mb in sizes:
            results = asyncio.run(run(mb << 20, args.iters))
            sizes_out[str(mb)] = {
                "nbytes": mb << 20,
                "median_ms": {k: statistics.median(v) * 1e3 for k, v in results.items()},
                "digest_cost_ms": {k: {"paired_median": extra * 1e3, "plain_median": base * 1e3}
                                   for k, (extra, base) in digest_cost(results).items()},
                "times_s": results,
            }
        record["rounds"].append(sizes_out)
    record["machine"]["loadavg_after"] = os.getloadavg()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
