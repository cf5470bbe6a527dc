"""bench.records: large committed records are gzip-compressed in git, every Markdown
reference to them follows, and the readers take either form."""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

from bench import records


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                          text=True).stdout


def test_compress_rewrites_references_and_readers_take_both(tmp_path: Path) -> None:
    root = tmp_path
    _git(root, "init", "-q")
    run = root / "docs" / "bench" / "run"
    run.mkdir(parents=True)
    big = {"requests": [{"index": i, "ttft_ms": i * 1.5} for i in range(2000)]}
    (run / "rate_0.2.json").write_text(json.dumps(big))
    (run / "rate_0.45.json").write_text(json.dumps({"small": True}))
    (run / "engine_profile_x.json").write_text(json.dumps(big))  # kept: loaded by name
    (run / "README.md").write_text("See rate_0.2.json and rate_0.45.json; not xrate_0.2.json.\n")
    (root / "docs" / "BENCHMARKS.md").write_text(
        "[r](bench/run/rate_0.2.json), `docs/bench/run/rate_0.2.json`, "
        "bench/run/rate_0.2.json.gz stays.\n")
    (root / "README.md").write_text("docs/bench/run/rate_0.2.json\n")
    _git(root, "add", "-A")
    done = records.compress([root / "docs" / "bench"], 16 * 1024, root=root)
    assert done == [run / "rate_0.2.json"]
    tracked = set(_git(root, "ls-files").split())
    assert "docs/bench/run/rate_0.2.json.gz" in tracked
    assert "docs/bench/run/rate_0.2.json" not in tracked and not (run / "rate_0.2.json").exists()
    assert {"docs/bench/run/rate_0.45.json", "docs/bench/run/engine_profile_x.json"} <= tracked
    assert (run / "README.md").read_text() == (
        "See rate_0.2.json.gz and rate_0.45.json; not xrate_0.2.json.\n")
    assert (root / "docs" / "BENCHMARKS.md").read_text() == (
        "[r](bench/run/rate_0.2.json.gz), `docs/bench/run/rate_0.2.json.gz`, "
        "bench/run/rate_0.2.json.gz stays.\n")
    assert (root / "README.md").read_text() == "docs/bench/run/rate_0.2.json.gz\n"
    with gzip.open(run / "rate_0.2.json.gz", "rt") as f:
        assert json.load(f) == big
    # Readers: by the plain name, by the compressed one, in a glob; a plain file as before.
    assert records.read_json(run / "rate_0.2.json") == big
    assert records.read_json(run / "rate_0.2.json.gz") == big
    assert records.read_json(run / "rate_0.45.json") == {"small": True}
    assert records.exists(run / "rate_0.2.json") and not records.exists(run / "rate_9.json")
    assert records.glob(run, "rate_*.json") == [run / "rate_0.2.json", run / "rate_0.45.json"]
    # No time in the gzip header: the same record compresses to the same bytes.
    assert (run / "rate_0.2.json.gz").read_bytes()[4:8] == b"\0\0\0\0"
    records.write_json(tmp_path / "again.json.gz", big)
    assert records.read_json(tmp_path / "again.json.gz") == big
