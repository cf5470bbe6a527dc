"""What the servers' fixed HTTP/2 receive window costs a legitimate request (issue 21, item 4).

    python -m bench.grpc_window [--reps 200] [--out docs/bench/grpc_window.json]

`pdserve.rpc.transport.server_options` turns grpc's bandwidth-delay probe off, so a server's
receive window stays at HTTP/2's 64 KiB a stream and a caller without credentials cannot push
megabytes into a worker before it is refused. This measures the other side: two grpc.aio
servers in their own processes (each pinned to one CPU where there are two), one with
`server_options()` and one with the probe on, the rest equal, each with one unary method that
takes bytes and answers their length. The client (this process) sends messages of 4 KiB (a
~800-token prompt), 64 KiB, 256 KiB and 1 MiB (the largest request a worker takes for an 8k
context) one at a time, alternating between the servers so both see the same machine, and
prints p50/p99 latency per size and the ratio probe-off / probe-on.

Loopback has almost no round-trip time, so this is what the window costs in CPU and wake-ups;
between hosts a message over the window also waits one round trip per 64 KiB window update
(a prompt of 8k tokens is ~40 KiB: one window).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from bench import commit_id
from pdserve.cluster import free_port, wait_port
from pdserve.deathsig import guarded
from pdserve.engine.cpu import cpu_summary
from pdserve.rpc.transport import channel_options, server_options

METHOD = "/window.W/Put"
SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20)


async def _serve(port: int, bdp_probe: bool) -> None:
    async def put(request: bytes, context: Any) -> bytes:
        return len(request).to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler("window.W", {
        "Put": grpc.unary_unary_rpc_method_handler(
            put, request_deserializer=lambda b: b, response_serializer=lambda b: b)})
    server = grpc.aio.server(options=server_options(bdp_probe=int(bdp_probe)))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _measure(ports: dict[str, int], reps: int) -> dict[str, Any]:
    channels = {name: grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
                for name, port in ports.items()}
    try:
        calls = {name: ch.unary_unary(METHOD, request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
                 for name, ch in channels.items()}
        times: dict[str, dict[int, list[float]]] = {n: {s: [] for s in SIZES} for n in ports}
        for name in ports:  # warm both connections up (and let the probe grow its window)
            for size in SIZES:
                for _ in range(10):
                    await calls[name](b"\0" * size, timeout=30)
        for i in range(reps):
            for size in SIZES:
                payload = bytes([i & 0xFF]) * size
                for name in (list(ports) if i % 2 else list(ports)[::-1]):
                    started = time.perf_counter()
                    reply = await calls[name](payload, timeout=30)
                    times[name][size].append(time.perf_counter() - started)
                    assert int.from_bytes(reply, "little") == size
    finally:
        for ch in channels.values():
            await ch.close()
    out: dict[str, Any] = {}
    for size in SIZES:
        row: dict[str, Any] = {
            name: {"p50_ms": round(1e3 * statistics.median(times[name][size]), 3),
                   "p99_ms": round(1e3 * statistics.quantiles(times[name][size], n=100)[98], 3)}
            for name in ports}
        row["p50_ratio_off_vs_on"] = round(
            row["probe_off"]["p50_ms"] / row["probe_on"]["p50_ms"], 3)
        out[str(size)] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)  # port, bdp (0/1)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(int(args.serve[0]), args.serve[1] == "1"))
        return
    ports = {"probe_off": free_port(), "probe_on": free_port()}
    cpus = sorted(os.sched_getaffinity(0))
    procs = []
    try:
        for i, (name, port) in enumerate(ports.items()):
            pin = ["taskset", "-c", str(cpus[i % len(cpus)])] if len(cpus) > 1 else []
            proc = subprocess.Popen(guarded(
                [*pin, sys.executable, "-m", "bench.grpc_window", "--serve", str(port),
                 "1" if name == "probe_on" else "0"]))
            procs.append(proc)
            wait_port(port, proc, timeout_s=60, what=f"server ({name})")
        results = asyncio.run(_measure(ports, args.reps))
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)
    record = {
        "bench": "grpc_window", "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit_id(),
        "cpu": cpu_summary(),
        "cpus": len(cpus), "grpc": grpc.__version__, "reps": args.reps, "sizes": results,
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
