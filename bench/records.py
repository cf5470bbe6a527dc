"""Benchmark records as committed under docs/bench: read them whether or not they are
compressed, and compress the large ones.

    python -m bench.records compress [--min-kb 32] [--dry-run] [DIR ...]

A record is written as plain JSON (or text) by the benchmark that makes it. Records of
`--min-kb` or more are committed gzip-compressed, `name.json.gz` beside where `name.json`
was (`compress`): the working tree stays small enough to travel whole to a lent machine
(the device tool takes 64 MiB at most), and the numbers stay where the docs say they come
from. `compress` gzips each tracked file of those kinds under DIR (default docs/bench) at or
over the size, replaces it in git, and rewrites every reference to it in the Markdown files
under docs/ and in README.md to the `.gz` name. Readers here (`read_json`, `exists`,
`glob`) take either form, so a tool pointed at a record directory works on both.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GZ = ".gz"
KINDS = (".json", ".jsonl", ".log", ".txt", ".out")  # what `compress` takes
# ... except the simulator's step-cost profiles and co-run tables, which it and its commands
# load by name (bench.sim.workers.PROFILE): small enough to stay as they are.
KEEP = re.compile(r"engine_(profile|corun)")


def _gz(path: Path) -> Path:
    return path.with_name(path.name + GZ)


def exists(path: Path) -> bool:
    """`path` is there, plain or compressed."""
    return path.exists() or _gz(path).exists()


def read_text(path: Path) -> str:
    """`path`'s text, or that of `path.gz` where only that is there (a path named `.gz` is
    read decompressed)."""
    if not path.exists() and _gz(path).exists():
        path = _gz(path)
    if path.suffix == GZ:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text()


def read_json(path: Path) -> Any:
    """`path` parsed as JSON, plain or compressed (`read_text`)."""
    return json.loads(read_text(path))


def _write_gz(path: Path, data: bytes) -> None:
    """`data` gzip-compressed into `path`, with no time in the header: the same record
    gives the same bytes."""
    with gzip.GzipFile(path, "wb", compresslevel=9, mtime=0) as f:
        f.write(data)


def write_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON into `path`, compressed where its name ends in `.gz`."""
    text = json.dumps(obj, indent=1) + "\n"
    if path.suffix == GZ:
        _write_gz(path, text.encode())
    else:
        path.write_text(text)


def glob(root: Path, pattern: str) -> list[Path]:
    """`root.glob(pattern)`, each compressed match named as its plain file (which
    `read_json` reads), sorted and without duplicates."""
    found = set(root.glob(pattern))
    found |= {p.with_name(p.name[: -len(GZ)]) for p in root.glob(pattern + GZ)}
    return sorted(found)


def _tracked(root: Path, paths: Iterable[Path]) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *map(str, paths)], cwd=root,
                         check=True, capture_output=True).stdout
    return [root / p for p in out.decode().split("\0") if p]


def _references(root: Path, docs: list[Path], moved: list[Path]) -> dict[Path, str]:
    """The Markdown files whose text changes when each of `moved` gains `.gz`: every
    mention of it by a path relative to the Markdown file or to the repository root."""
    changed: dict[Path, str] = {}
    for md in docs:
        text = original = md.read_text()
        for path in moved:
            for ref in {os.path.relpath(path, md.parent), str(path.relative_to(root))}:
                text = re.sub(rf"(?<![\w./-]){re.escape(ref)}(?![\w.-]*\w)(?!\.gz)",
                              ref + GZ, text)
        if text != original:
            changed[md] = text
    return changed


def compress(dirs: list[Path], min_bytes: int, dry_run: bool = False, *,
             root: Path = ROOT) -> list[Path]:
    """Gzip the tracked records at or over `min_bytes` under `dirs` (see the module
    docstring) in the git checkout `root`; returns the files compressed."""
    big = [p for p in _tracked(root, dirs)
           if p.suffix in KINDS and not KEEP.match(p.name) and p.is_file()
           and p.stat().st_size >= min_bytes]
    docs = [p for p in _tracked(root, [root / "docs", root / "README.md"]) if p.suffix == ".md"]
    changed = _references(root, docs, big)
    before = sum(p.stat().st_size for p in big)
    if not dry_run:
        for path in big:
            _write_gz(_gz(path), path.read_bytes())
        rel = [str(p.relative_to(root)) for p in big]
        for i in range(0, len(rel), 200):
            subprocess.run(["git", "rm", "-q", "--cached", "--", *rel[i:i + 200]], cwd=root,
                           check=True)
            for r in rel[i:i + 200]:
                (root / r).unlink()
            subprocess.run(["git", "add", "--", *[r + GZ for r in rel[i:i + 200]]], cwd=root,
                           check=True)
        for md, text in changed.items():
            md.write_text(text)
        after = sum(_gz(p).stat().st_size for p in big)
        print(f"compressed {len(big)} files: {before / 2**20:.1f} MiB -> "
              f"{after / 2**20:.1f} MiB; references rewritten in {len(changed)} Markdown files")
    else:
        print(f"would compress {len(big)} files ({before / 2**20:.1f} MiB) and rewrite "
              f"references in {len(changed)} Markdown files")
    return big


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compress", help="gzip the large tracked records")
    c.add_argument("dirs", nargs="*", type=Path, default=[ROOT / "docs" / "bench"])
    c.add_argument("--min-kb", type=int, default=32)
    c.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    compress([d.resolve() for d in a.dirs], a.min_kb * 1024, a.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
