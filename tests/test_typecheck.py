"""Static checks of the runtime packages, run as part of the test suite.

- mypy, with the settings of pyproject.toml [tool.mypy] (strict about the runtime code: every
  def annotated, unused `type: ignore`s reported), must report nothing. Its incremental cache
  (.mypy_cache, git-ignored) makes later runs take seconds.
- `ruff analyze graph` must resolve every project import: for each runtime file, every
  `import X` / `from X import y` of one of our top-level packages shows up as an edge to the
  file it names. An import it cannot resolve (a module that moved or does not exist) is missing
  from the graph, as it is for every tool that maps files to modules this way.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("pdserve", "router", "prefill_svc", "decode_svc", "kvxfer")
GENERATED = ROOT / "pdserve" / "v1"  # protoc output, not checked (its .pyi stubs are read)


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_mypy_passes() -> None:
    proc = _run("mypy", *TOP_PACKAGES, timeout=540)
    code, output = proc.returncode, proc.stdout + proc.stderr
    assert code == 0, f"mypy failed (exit {code}):\n{output}"


def _runtime_files() -> list[Path]:
    return sorted(
        p for top in TOP_PACKAGES for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts and GENERATED not in p.parents
    )


def _module_file(module: str) -> list[str]:
    """The repo-relative files that may stand for `module` (import path = file path)."""
    base = ROOT.joinpath(*module.split("."))
    candidates = (base.with_suffix(".py"), base.with_suffix(".pyi"), base / "__init__.py")
    return [c.relative_to(ROOT).as_posix() for c in candidates if c.is_file()]


def _package_of(path: Path) -> list[str]:
    """The package a relative import in `path` starts from (a package's own, for __init__)."""
    return list(path.relative_to(ROOT).parts[:-1])


def _project_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, import as written, files it may resolve to) for each project module that `path`
    imports anywhere (function bodies and `if TYPE_CHECKING:` included). An empty list of
    files: no such module."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [(f"import {alias.name}", alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(path)
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            # `from m import x` names the module m.x when there is one, else m.
            targets = [(f"from {'.' * node.level}{node.module or ''} import {alias.name}",
                        f"{base}.{alias.name}" if _module_file(f"{base}.{alias.name}") else base)
                       for alias in node.names]
        else:
            continue
        for written, module in targets:
            if module.split(".")[0] in TOP_PACKAGES:
                found.append((node.lineno, written, _module_file(module)))
    return found


@cache
def _ruff_graph() -> dict[str, list[str]]:
    proc = _run("ruff", "analyze", "graph", *TOP_PACKAGES, timeout=120)
    assert proc.returncode == 0, f"ruff analyze graph failed:\n{proc.stdout}{proc.stderr}"
    graph: dict[str, list[str]] = json.loads(proc.stdout)
    return graph


def test_ruff_import_graph_resolves_every_project_import() -> None:
    graph = _ruff_graph()
    files = _runtime_files()
    router = ROOT / "router" / "router.py"
    assert router in files and _project_imports(router), "router/router.py imports nothing?"
    problems = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel not in graph:
            problems.append(f"{rel}: not in the graph")
            continue
        edges = set(graph[rel])
        for line, written, candidates in _project_imports(path):
            if not candidates:
                problems.append(f"{rel}:{line}: {written}: no such module")
            elif not edges & set(candidates):
                problems.append(f"{rel}:{line}: {written}: not resolved (want one of "
                                f"{', '.join(candidates)})")
    assert not problems, "ruff analyze graph does not resolve:\n" + "\n".join(problems)
