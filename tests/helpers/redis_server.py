"""A real, throwaway redis-server for tests.

Import the fixture into a conftest (``from tests.helpers.redis_server import redis_server``).
It never touches a Redis that may already run on 6379: it picks a free port, runs without
persistence in a temporary directory, and is killed when the session ends.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cluster import free_port

_START_TIMEOUT_S = 10.0


def _free_port() -> int:
    return free_port()  # below the ephemeral range (pdserve.cluster.free_port)


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _start(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    for _ in range(5):  # another process may grab the port between probe and bind
        port = _free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if _ping(port):
                return proc, port
            time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=5)
    raise RuntimeError("could not start redis-server")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a private redis-server, e.g. ``redis://127.0.0.1:53211/0``."""
    proc, port = _start(tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
