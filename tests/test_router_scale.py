"""bench.router_scale --quick end to end (a real redis-server and a publisher process): every
section is in the record, and the router's KV index equals the workers' real caches, through
Redis (section 3) and in the hit-rate simulation (section 4). No timing is asserted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"index", "oracle", "load_only", "round_robin", "random"}


def _run_quick(out: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.router_scale", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n" \
                                 f"{proc.stderr[-4000:]}"
    rec: dict[str, Any] = json.loads(out.read_text())
    return rec


def test_router_scale_quick_record(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None and not Path("/usr/bin/redis-server").exists():
        pytest.skip("redis-server is not installed")
    rec = _run_quick(tmp_path / "r.json")
    assert rec["quick"] is True

    m = rec["machine"]
    assert m["cpu_model"] and m["python"] and m["date"]
    assert set(m["cpu_flags"]) == {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}
    assert "git_commit" in m

    d = rec["decision"]
    assert [r["workers"] for r in d["results"]] == [1, 8, 64, 256]
    for r in d["results"]:
        assert r["requests"] > 0 and r["index_blocks"] >= rec["config"]["index_blocks"]
        assert r["index_entries"] >= r["index_blocks"]
        for key in ("decisions_per_s", "mean_us", "p50_us", "p99_us"):
            assert r[key] > 0
        assert 0 < r["mean_cached_fraction"] <= 1  # the index finds the corpus' prefixes
    assert {"match_prompt", "rest", "place", "full_hash", "full_match"} <= d["split"].keys()
    assert all(r["decisions_per_cpu_s"] > 0 for r in d["results"])
    assert d["split"]["native_hashing"] is True  # setup.py builds pdserve/_blockhash.c
    assert d["split"]["workers"] == 64
    assert {"64", "256"} <= d["profile_top_tottime"].keys()

    assert [r["workers"] for r in rec["memory"]] == [1, 8, 64, 256]
    for r in rec["memory"]:
        assert r["memory_bytes"] > 0 and r["tracemalloc_bytes"] > 0

    e = rec["events"]
    assert e["ops"] >= rec["config"]["events_ops"]
    for mode in ("live", "drain"):
        assert e[mode]["mismatched_workers"] == [] and e[mode]["resyncs"] == 0
        assert e[mode]["ops_per_s"] > 0
    assert e["index_equals_caches"] is True
    assert e["index_entries"] == e["cached_blocks_total"]

    h = rec["hit_rate"]
    assert h["runs"]
    for run in h["runs"].values():
        assert set(run["policies"]) == POLICIES
        for result in run["policies"].values():
            assert 0 <= result["hit_rate"] <= 1
        assert run["policies"]["index"]["index_equals_caches"] is True
    assert h["index_equals_caches"] is True
