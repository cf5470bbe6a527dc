"""Stop 73: text, chat and remote-prefill requests through the compiled data plane, on a real
cluster, for an A/B of two trees (run it from each tree in turn: `ab.sh`).

One LocalCluster of this tree (1 prefill + 1 decode worker, the default model, the router
with `--data-plane compiled --placement threshold --remote-threshold 256`), then one request
at a time over one channel, `--n` of each kind after 3 warm-up requests: a short text prompt
and a chat prompt (both routed locally) and a ~450-token token-id prompt (a remote prefill),
16 greedy tokens each. Per kind: the router process's CPU seconds per request (utime + stime
from /proc over the kind's requests), and net of its background: less what it spent idle
over as long, measured over `--idle-s` before the kind's requests (directory polls, KV
events, metrics: most of a remote prefill's share, which waits ~0.6 s for its prefill); the
client's TTFT and total time (p50), and what the data plane counted
(`pdserve_router_data_plane_calls_total` by path).

    python docs/bench/dataplane_s73/text_ab.py --out F.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster import LocalCluster
from pdserve.rpc import transport
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

TEXT = "The capital of France is"
CHAT = [router_pb2.ChatMessage(role="user", content="Name three colors.")]
PATHS = ("routed", "remote", "relayed", "refused", "handed_back")


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _paths(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out = dict.fromkeys(PATHS, 0.0)
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == "pdserve_router_data_plane_calls_total":
                out[s.labels["path"]] = s.value
    return out


async def _one(stub: router_pb2_grpc.RouterStub, req: router_pb2.GenerateRequest
               ) -> tuple[float, float, int]:
    started = time.perf_counter()
    ttft = None
    route = 0
    async for resp in stub.Generate(req, timeout=300):
        if ttft is None and resp.token_ids:
            ttft = time.perf_counter() - started
        route = resp.route or route
    assert ttft is not None
    return ttft, time.perf_counter() - started, route


async def _run(cluster: LocalCluster, pid: int, n: int, idle_s: float) -> dict[str, object]:
    greedy = common_pb2.SamplingParams(max_tokens=16, temperature=0.0)
    long_ids = [(i * 7919) % 30000 + 100 for i in range(450)]
    kinds = {
        "text": lambda i: router_pb2.GenerateRequest(text=f"{TEXT} {i}", sampling=greedy),
        "chat": lambda i: router_pb2.GenerateRequest(
            chat=router_pb2.ChatMessages(messages=CHAT), sampling=greedy),
        "remote": lambda i: router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=[i + 1, *long_ids]), sampling=greedy),
    }
    out: dict[str, object] = {}
    async with transport.insecure_channel(cluster.grpc_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        await ch.channel_ready()
        for kind, make in kinds.items():
            for i in range(3):
                await _one(stub, make(10_000 + i))
            idle0, i0 = _cpu_s(pid), time.perf_counter()
            await asyncio.sleep(idle_s)
            idle_per_s = (_cpu_s(pid) - idle0) / (time.perf_counter() - i0)
            paths0, cpu0 = _paths(cluster.http_url), _cpu_s(pid)
            t0 = time.perf_counter()
            got = [await _one(stub, make(i)) for i in range(n)]
            wall = time.perf_counter() - t0
            cpu1, paths1 = _cpu_s(pid), _paths(cluster.http_url)
            out[kind] = {
                "n": n, "wall_s": round(wall, 3),
                "router_cpu_ms_per_request": round((cpu1 - cpu0) / n * 1e3, 3),
                "router_idle_cpu_per_s": round(idle_per_s, 4),
                "router_cpu_ms_per_request_net": round(
                    (cpu1 - cpu0 - idle_per_s * wall) / n * 1e3, 3),
                "ttft_ms_p50": round(statistics.median(g[0] for g in got) * 1e3, 2),
                "total_ms_p50": round(statistics.median(g[1] for g in got) * 1e3, 2),
                "routes": sorted({g[2] for g in got}),
                "paths": {p: paths1[p] - paths0[p] for p in PATHS},
            }
            print(kind, json.dumps(out[kind]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cluster = LocalCluster(prefill=1, decode=1, extra_worker_args=("--threads", "1"),
                           router_args=("--data-plane", "compiled", "--placement", "threshold",
                                        "--remote-threshold", "256"))
    try:
        cluster.start()
        pid = cluster.procs["router"].pid
        result = asyncio.run(_run(cluster, pid, args.n, args.idle_s))
    finally:
        cluster.close()
    with open(args.out, "w") as f:
        json.dump({"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "cpu": os.cpu_count(), "results": result}, f, indent=1)


if __name__ == "__main__":
    main()
