"""Benchmarks for pdserve. `bench.loadgen` drives any OpenAI-compatible endpoint."""

from __future__ import annotations

from typing import Any


def commit_id() -> str:
    """The checkout's commit for a record, with `-dirty` when the tree has changes
    ("unknown" outside a git checkout)."""
    import subprocess

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def emit(record: dict[str, Any], out: Any, keys: tuple[str, ...]) -> None:
    """Write `record` as JSON to `out` (a Path, or None for no file) and print its `keys` as
    one JSON line."""
    import json

    if out is not None:
        out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(json.dumps({k: record[k] for k in keys}, default=str))


def build_cpu_ops(source: str, name: str, march: str | None = None) -> Any:
    """`source` (a cpu_ops.cpp) compiled apart into a scratch directory, with the engine's
    own flags (`kernels.CFLAGS`), `-march` replaced by `march` if given."""
    import tempfile
    from pathlib import Path

    from torch.utils import cpp_extension

    from pdserve.engine import kernels

    flags = [f"-march={march}" if march and f.startswith("-march=") else f
             for f in kernels.CFLAGS]
    build = Path(tempfile.mkdtemp(prefix="pdserve_cpu_ops_"))
    (build / "cpu_ops.cpp").write_text(source)
    return cpp_extension.load(name=name, sources=[str(build / "cpu_ops.cpp")],
                              build_directory=str(build), verbose=False, extra_cflags=flags,
                              extra_ldflags=["-fopenmp"])


def build_at(rev: str) -> Any:
    """REV's cpu_ops.cpp, compiled as the engine compiles its own."""
    import subprocess
    from pathlib import Path

    from pdserve.engine import kernels

    rel = kernels._SOURCE.resolve().relative_to(Path.cwd().resolve())
    src = subprocess.run(["git", "show", f"{rev}:{rel}"], check=True, capture_output=True,
                         text=True).stdout
    return build_cpu_ops(src, f"pdserve_cpu_ops_at_{rev.replace('/', '_')}")
