"""Idle wake-ups and KV hand-over latency of a 1P1D cluster at two ucxx progress-thread
epoll timeouts (kvxfer.progress, PDSERVE_UCX_EPOLL_TIMEOUT_MS).

    python -m bench.ucx_epoll_ab --timeouts 1,100 --json docs/bench/ucx_epoll_ab_<commit>.json

Per timeout: a fresh `LocalCluster` (1 prefill, 1 decode, remote threshold 64); strace counts
the idle decode worker's epoll_wait/read/poll/futex calls for 3 s; then 12 remote requests
(200 fresh prompt tokens, 8 out) report the prefill worker's KV transfer time and the
hand-off, from the router's stage timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any


async def remote_request(address: str, ids: list[int]) -> dict[str, Any]:
    """One request through the router's gRPC API, 8 greedy tokens, with its stage timings."""
    import grpc

    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    req = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=ids), return_timings=True,
        sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0))
    t = time.monotonic()
    first: float | None = None
    route, timings = 0, common_pb2.StageTimings()
    async with grpc.aio.insecure_channel(address) as ch:
        async for resp in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=300):
            if first is None and resp.token_ids:
                first = time.monotonic() - t
            if resp.HasField("timings"):
                timings = resp.timings
            route = resp.route or route
    return {"route": route, "total_ms": (time.monotonic() - t) * 1e3,
            "ttft_ms": (first or 0.0) * 1e3, "kv_transfer_ms": timings.kv_transfer_ms,
            "handoff_ms": timings.handoff_ms}


def measure(timeout_ms: str, requests: int) -> dict[str, Any]:
    from pdserve.cluster import LocalCluster
    from pdserve.engine.model_store import resolve_model

    c = LocalCluster(prefill=1, decode=1, model=str(resolve_model(None, progress=False)),
                     extra_worker_args=("--kv-cache-mb", "256"),
                     router_args=("--placement", "threshold", "--remote-threshold", "64"),
                     env={"PDSERVE_UCX_EPOLL_TIMEOUT_MS": timeout_ms})
    c.start(timeout_s=300)
    try:
        pid = c.procs["decode-0"].pid
        out = subprocess.run(["timeout", "3", "strace", "-f", "-c", "-e",
                              "trace=epoll_wait,read,poll,futex", "-p", str(pid)],
                             capture_output=True, text=True).stderr
        calls = sum(int(line.split()[3]) for line in out.splitlines()
                    if re.match(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+\d+", line))
        rng = random.Random(2)

        async def run() -> list[dict[str, Any]]:
            return [await remote_request(
                c.grpc_address, [rng.randrange(100, 40000) for _ in range(200)])
                for _ in range(requests)]

        rows = asyncio.run(run())
    finally:
        c.close()

    def p50(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {"epoll_timeout_ms": int(timeout_ms), "idle_syscalls_3s": calls,
            "kv_transfer_ms_p50": p50("kv_transfer_ms"),
            "kv_transfer_ms_max": max(r["kv_transfer_ms"] for r in rows),
            "handoff_ms_p50": p50("handoff_ms"), "ttft_ms_p50": p50("ttft_ms"),
            "total_ms_p50": p50("total_ms"), "requests": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeouts", default="1,100")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from bench.bench_kvxfer import machine

    results = [measure(t, args.requests) for t in args.timeouts.split(",")]
    for r in results:
        print(f"epoll timeout {r['epoll_timeout_ms']} ms: idle syscalls in 3 s "
              f"{r['idle_syscalls_3s']}, kv_transfer p50 {r['kv_transfer_ms_p50']:.2f} ms "
              f"(max {r['kv_transfer_ms_max']:.2f}), handoff p50 {r['handoff_ms_p50']:.2f} ms, "
              f"TTFT p50 {r['ttft_ms_p50']:.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
