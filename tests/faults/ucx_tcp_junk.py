"""Raw TCP junk against a KV receiver's UCX sockaddr listener, in a process of its own.

Run by `test_kv_listener.py` as `python -m tests.faults.ucx_tcp_junk small|large` from the
repository root. It prints one JSON line: whether real transfers worked during and after the
attack, and the CPU the process burned while idle afterwards. A child process, because the
attack can leave libucx's async thread spinning for the rest of the process's life (see the
test), which must not slow every later test of the session.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

from hypothesis import strategies as st

# Before test_kv_listener imports ucxx: kvxfer must load its listener library first (the
# isort order keeps it there).
from kvxfer import KVReceiver
from tests.faults.test_kv_listener import (
    DESC_ID,
    FRAME_TIMEOUT_S,
    LAYOUT,
    _correct_transfer,
    _draw,
    _host_port,
    _pool,
    _until_idle,
)

IDLE_WINDOW_S = 3.0


def junk(mode: str) -> list[bytes]:
    """`small`: payloads that fit libucx's connection-request buffer (< 4 KiB); `large`:
    payloads that overflow it."""
    if mode == "small":
        return [*_draw(st.binary(min_size=0, max_size=2048), 30),
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]
    return [b"\x00" * (1 << 20), b"\xff" * 65536, b"\x00" * 4096]


def _cpu_ticks() -> int:
    """User + system clock ticks of every thread of this process."""
    fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def _send(host: str, port: int, data: bytes, keep: list[socket.socket]) -> None:
    s = socket.create_connection((host, port), timeout=2)
    try:
        s.sendall(data)
    except OSError:
        pass  # the listener may close on us: fine
    keep.append(s)


async def attack(mode: str) -> dict[str, object]:
    async with KVReceiver(_pool(1), LAYOUT, DESC_ID, frame_timeout_s=FRAME_TIMEOUT_S,
                          fence_grace_s=0.1, fence_timeout_s=3.0, max_connections=32) as rx:
        host, port = _host_port(rx)
        held: list[socket.socket] = []
        loop = asyncio.get_running_loop()
        try:
            for data in junk(mode):
                await loop.run_in_executor(None, _send, host, port, data, held)
            for _ in range(40):  # half-open: connected, silent
                held.append(await loop.run_in_executor(
                    None, lambda: socket.create_connection((host, port), timeout=2)))
            await asyncio.sleep(0.5)
            await _correct_transfer(rx)  # while every junk connection is still open
        finally:
            for s in held:
                s.close()
        await asyncio.sleep(0.5)
        await _until_idle(rx)
        await _correct_transfer(rx)
        await asyncio.sleep(1.0)
        before, start = _cpu_ticks(), time.monotonic()
        await asyncio.sleep(IDLE_WINDOW_S)
        ticks = _cpu_ticks() - before
        idle_cpu = 100.0 * ticks / os.sysconf("SC_CLK_TCK") / (time.monotonic() - start)
        return {"mode": mode, "transfers_ok": True, "idle_cpu_pct": round(idle_cpu, 1)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(attack(sys.argv[1]))), flush=True)
    os._exit(0)  # a spinning libucx thread must not hold up interpreter shutdown
