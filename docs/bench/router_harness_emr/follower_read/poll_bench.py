"""One KVIndexFollower.poll() against a real redis-server with N workers' KV event streams,
each worker synced from a snapshot, then one worker publishing a one-op batch before each
poll (what a busy router reads most of the time): the poll's CPU time (thread time, so the
Redis server's own time is not in it), the publish not timed: python poll_bench.py N
[rounds] (PYTHONPATH = the repository)."""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from pdserve.control.kv_events import KVEventStreams
from pdserve.control.registry import WorkerRegistry
from pdserve.kv_events import KVEventBatch, KVOp
from router.kv_follow import KVIndexFollower
from router.kv_index import KVIndex


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis() -> tuple[subprocess.Popen[bytes], int, str]:
    port = free_port()
    d = tempfile.mkdtemp()
    srv = subprocess.Popen(["taskset", "-c", "1", shutil.which("redis-server") or "redis-server",
                            "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    return srv, port, d


async def main(n: int, rounds: int, port: int) -> dict[str, object]:
    async with WorkerRegistry.from_url(f"redis://127.0.0.1:{port}", namespace="pb") as reg:
        streams = KVEventStreams(reg)
        ids = [f"decode-{i:04d}" for i in range(n)]
        for i, w in enumerate(ids):
            await streams.publish(w, KVEventBatch(
                epoch=1, seq=0, snapshot=True, block_size=16,
                ops=((KVOp.STORED, i.to_bytes(16, "little")),)))
        index = KVIndex()
        try:  # as the router makes it: the workers listed again when the view changes
            follower = KVIndexFollower(streams, index, lambda: ids, block_ms=100,
                                       version=lambda: 0)
        except TypeError:  # before it could say so
            follower = KVIndexFollower(streams, index, lambda: ids, block_ms=100)
        while sum(index.synced(w) for w in ids) < n:
            await follower.poll()
        seq = [0] * n
        cpu = []
        for r in range(rounds):
            k = r % n
            seq[k] += 1
            await streams.publish(ids[k], KVEventBatch(
                epoch=1, seq=seq[k], snapshot=False, block_size=16,
                ops=((KVOp.STORED, (n + r).to_bytes(16, "little")),)))
            t0 = time.thread_time_ns()
            got = await follower.poll()
            cpu.append(time.thread_time_ns() - t0)
            assert got == 1, got
        total = sum(cpu)
        cpu.sort()
        import redis.utils
        return {"workers": n, "rounds": rounds, "hiredis": redis.utils.HIREDIS_AVAILABLE,
                "poll_cpu_us_total_mean": total / rounds / 1e3,
                "poll_cpu_us_p50": cpu[len(cpu) // 2] / 1e3,
                "poll_cpu_us_mean": sum(cpu) / len(cpu) / 1e3,
                "poll_cpu_us_p90": cpu[int(len(cpu) * 0.9)] / 1e3}


os.sched_setaffinity(0, {0})
server, redis_port, redis_dir = start_redis()
try:
    print(json.dumps(asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2
                                      else 2000, redis_port))))
finally:
    server.terminate()
    server.wait()
    shutil.rmtree(redis_dir, ignore_errors=True)
