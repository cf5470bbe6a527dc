"""What one in-flight exchange, one push, and one push with a follower receiving it cost the
router's process in CPU (pdserve.control.inflight on a real redis-server of its own), with
counts on 64 decode workers, unsigned and signed: the process's CPU time per call (the
record's making and redis-py's work; Redis itself runs in its own process). Prints the CPU
model and flags, the commit and whether redis-py found hiredis first.
usage: PYTHONPATH=. python docs/bench/placement_s82/redis_cost.py"""
import asyncio
import platform
import re
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import redis.utils

from pdserve.control import WorkerRegistry
from pdserve.control.inflight import InflightBoard, InflightCounts
from pdserve.control.signing import signer_for
from pdserve.rpc.auth import ClusterSecret

cpu = Path("/proc/cpuinfo").read_text()
model = re.search(r"model name\s*:\s*(.*)", cpu)
flags = set(re.search(r"flags\s*:\s*(.*)", cpu).group(1).split())  # type: ignore[union-attr]
known = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
print(f"cpu: {model.group(1) if model else platform.processor()}; "
      f"{' '.join(f for f in known if f in flags)}; commit {commit}; "
      f"hiredis {redis.utils.HIREDIS_AVAILABLE}")
N = 1000


async def per_call(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.process_time()
    for _ in range(N):
        await fn()
    return (time.process_time() - start) / N * 1e6


async def main(port: int) -> None:
    placed = {f"decode-{i}": 2 for i in range(64)}
    for signed in (False, True):
        ns = uuid.uuid4().hex[:8]
        signer = signer_for(ClusterSecret(b"k" * 32), ns) if signed else None
        async with WorkerRegistry.from_url(f"redis://127.0.0.1:{port}/0", namespace=ns,
                                           signer=signer) as reg:
            a, b = InflightBoard(reg, "router-a"), InflightBoard(reg, "router-b")
            await b.exchange(placed, {})
            exchange = await per_call(lambda a=a: a.exchange(placed, {}))
            push = await per_call(lambda a=a: a.push(placed, {}))
            got: list[InflightCounts] = []
            all_in = asyncio.Event()

            def receive(counts: InflightCounts, got: list[InflightCounts] = got,
                        all_in: asyncio.Event = all_in) -> None:
                got.append(counts)
                if len(got) == N:
                    all_in.set()
            follower = asyncio.create_task(b.follow(receive))
            await asyncio.sleep(0.5)
            start = time.process_time()
            for _ in range(N):
                await a.push(placed, {})
            await asyncio.wait_for(all_in.wait(), 30)
            both = (time.process_time() - start) / N * 1e6
            follower.cancel()
            print(f"64 workers, {'signed' if signed else 'open mode'}: exchange {exchange:.0f}"
                  f" us, push {push:.0f} us, push and its receipt {both:.0f} us of CPU")


with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    PORT = s.getsockname()[1]
exe = shutil.which("redis-server")
assert exe is not None
server = subprocess.Popen([exe, "--port", str(PORT), "--bind", "127.0.0.1", "--save", "",
                           "--appendonly", "no"], stdout=subprocess.DEVNULL)
try:
    time.sleep(0.5)
    asyncio.run(main(PORT))
finally:
    server.terminate()
    server.wait()
