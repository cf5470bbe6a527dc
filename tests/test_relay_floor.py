"""bench.grpc_relay_floor's relays carry every message through unchanged: the Python ones, the
compiled one (bench/relay_cxx/relay.cc, built here where g++ and grpc++'s headers are) and
each with a routing decision per request (`--decide`, the compiled relay then running inside
a Python process). The bench checks each relay's stream against the server's own before it
times anything; this runs it small."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


def _grpcxx() -> bool:
    return bool(shutil.which("g++") and shutil.which("pkg-config")) and subprocess.run(
        ["pkg-config", "--exists", "grpc++"], check=False).returncode == 0


@pytest.mark.parametrize("cxx", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _grpcxx(), reason="no g++ or grpc++ headers (Debian: libgrpc++-dev)"))])
def test_relays_carry_the_stream(tmp_path: Path, cxx: bool) -> None:
    out = tmp_path / "floor.json"
    cmd = [sys.executable, "-m", "bench.grpc_relay_floor", "--requests", "40", "--rounds", "2",
           "--tokens", "3", "--modes", "call", "mux", "--loops", "asyncio", "--decide", "4",
           "--index-blocks", "3000", "--out", str(out), *(["--cxx"] if cxx else [])]
    env_home = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500,
                          env=os.environ | env_home)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    relayed = json.loads(out.read_text())["relayed"]
    want = {"asyncio", "asyncio/mux", "asyncio/mux/decide"}
    if cxx:
        want |= {"cxx", "cxx/mux", "cxx/mux/decide"}
    assert set(relayed) == want
    for name, r in relayed.items():
        assert r["ttft_ms"]["p50"] > 0, name
