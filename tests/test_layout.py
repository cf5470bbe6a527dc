"""The package's shape, checked from source: import path = file path, no import cycles,
generated protobuf code only at the gRPC edges, and the engine used only through AsyncEngine's
public API.

Every .py under the top-level packages is parsed (never imported); its module name is its path
(`pdserve/engine/scheduler.py` is `pdserve.engine.scheduler`), with no mapping to know.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The top-level packages: shared code under pdserve/, and the service directories the project
# was specified with as packages of their own (setup.py SERVICE_PACKAGES).
TOP_PACKAGES = ("pdserve", "router", "prefill_svc", "decode_svc", "kvxfer")
GENERATED = "pdserve.v1"  # protoc output: imports its siblings, never checked

# The only modules that may import generated `*_pb2` / `*_pb2_grpc` code: servicers (protobuf
# in, domain call, protobuf out; the compiled data plane's Python side is the router's other
# servicer), the typed clients (the router's clients of the workers, and
# the public client of the router's API), the conversion module they use, and the gRPC
# transport (health service, channels).
PB2_ALLOWED = frozenset({
    "decode_svc.servicer",
    "prefill_svc.servicer",
    "router.servicer",
    "router.dataplane",
    "router.clients",
    "pdserve.client",
    "pdserve.rpc.convert",
    "pdserve.rpc.transport",
})
# Known exceptions still to be removed; each is an xfail (strict: it fails once fixed, so the
# entry gets deleted). Reasons say what is left to do.
PB2_KNOWN: dict[str, str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Installed module name -> source file, for every package module (stubs excluded)."""
    found: dict[str, Path] = {}
    for top in TOP_PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            name = _module_name(path)
            if name == GENERATED or name.startswith(GENERATED + "."):
                continue
            found[name] = path
    return found


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: not in functions or classes' methods,
    not under `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody,
                          *(h.body for h in node.handlers)):
                yield from _module_level_imports(block)
        elif isinstance(node, ast.With):
            yield from _module_level_imports(node.body)


def _imported_names(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """Full module names ``node`` imports (for `from m import x`: m.x if that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative import
        package = importer.split(".")
        if modules().get(importer, Path()).name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    names = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        names.append(sub if sub in modules() or sub.startswith(GENERATED + ".") else base)
    return names


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """module -> project modules it imports at module level. Importing `a.b.c` also runs the
    `a` and `a.b` packages' __init__, except those the importer is itself inside of."""
    graph: dict[str, frozenset[str]] = {}
    for name, path in modules().items():
        own = set(_ancestors(name))
        edges: set[str] = set()
        for node in _module_level_imports(_tree(path).body):
            for target in _imported_names(node, name):
                for t in (*_ancestors(target), target):
                    if t in modules() and t != name and t not in own:
                        edges.add(t)
        graph[name] = frozenset(edges)
    return graph


def _find_cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _all_imports(path: Path) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, ""


# --------------------------------------------------------------------------- the checks


def test_every_module_is_in_a_top_level_package() -> None:
    names = modules()
    assert "pdserve.engine.async_engine" in names and "router.router" in names
    assert all(n.split(".")[0] in TOP_PACKAGES for n in names)
    # The old `pdserve.<service>` spellings are gone for good.
    stale = sorted(
        f"{name}: {target}"
        for name, path in names.items()
        for node, _ in _all_imports(path)
        for target in _imported_names(node, name)
        if target.split(".")[:2] in (["pdserve", d] for d in TOP_PACKAGES[1:])
    )
    assert not stale, stale


def test_no_import_cycles() -> None:
    cycles = _find_cycles(import_graph())
    assert not cycles, "import cycles (module-level imports):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def _pb2_imports(name: str) -> list[str]:
    """Generated modules ``name`` imports anywhere (function bodies included)."""
    found = set()
    for node, _ in _all_imports(modules()[name]):
        for target in _imported_names(node, name):
            leaf = target.rsplit(".", 1)[-1]
            if leaf.endswith(("_pb2", "_pb2_grpc")) or target.startswith(GENERATED + "."):
                found.add(target)
    return sorted(found)


def _pb2_cases() -> list[object]:
    cases: list[object] = []
    for name in sorted(modules()):
        if name in PB2_KNOWN:
            cases.append(pytest.param(name, marks=pytest.mark.xfail(
                strict=True, reason=PB2_KNOWN[name])))
        elif name not in PB2_ALLOWED:
            cases.append(name)
    return cases


@pytest.mark.parametrize("module", _pb2_cases())
def test_generated_protobuf_code_only_at_the_grpc_edges(module: str) -> None:
    assert not _pb2_imports(module), f"{module} imports generated code: {_pb2_imports(module)}"


def test_allowed_protobuf_edges_exist() -> None:
    """The allow-list names real modules (a rename must update it, not silently widen it)."""
    missing = sorted(m for m in PB2_ALLOWED | set(PB2_KNOWN) if m not in modules())
    assert not missing, missing


def test_cycle_finder_finds_cycles() -> None:
    graph = import_graph()
    assert "pdserve.engine.async_engine" in graph["decode_svc.worker"]
    assert _find_cycles({"a": frozenset({"b"}), "b": frozenset({"c"}),
                         "c": frozenset({"a"}), "d": frozenset({"a"})}) == [["a", "b", "c"]]


def _async_engine_private_names() -> frozenset[str]:
    """`_names` AsyncEngine defines: its private methods and the attributes it sets."""
    tree = _tree(modules()["pdserve.engine.async_engine"])
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AsyncEngine")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "self"):
            names.add(node.attr)
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__"))


def _files_outside_engine() -> Iterator[tuple[str, Path]]:
    for name, path in modules().items():
        if not name.startswith("pdserve.engine"):
            yield name, path
    for top in ("tests", "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield str(path.relative_to(ROOT)), path


# Names an AsyncEngine goes by outside engine/ (attributes, fixtures, locals).
_ENGINE_NAMES = frozenset({"engine", "aengine", "eng", "aeng", "async_engine"})


def test_nothing_outside_the_engine_touches_async_engine_internals() -> None:
    private = _async_engine_private_names()
    assert {"_engine", "_streams", "_thread", "_stats"} <= private
    offenders = []
    for name, path in _files_outside_engine():
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Attribute):
                continue
            where = f"{name}:{node.lineno}"
            # `<x>.engine.engine` / `engine.engine`: an AsyncEngine reached through to its
            # LLMEngine.
            if node.attr == "engine" and (
                    (isinstance(node.value, ast.Attribute) and node.value.attr == "engine")
                    or (isinstance(node.value, ast.Name) and node.value.id in _ENGINE_NAMES)):
                offenders.append(f"{where}: .engine.engine")
            # `<x>.engine._name` / `<x>._engine`: AsyncEngine's private state.
            elif node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                receiver = node.value
                via_engine = (isinstance(receiver, ast.Attribute)
                              and receiver.attr in _ENGINE_NAMES) or (
                    isinstance(receiver, ast.Name) and receiver.id in _ENGINE_NAMES)
                if via_engine or node.attr == "_engine":
                    offenders.append(f"{where}: .{node.attr}")
    assert not offenders, "AsyncEngine internals used outside engine/: " + ", ".join(offenders)


def _setup_packages() -> list[str]:
    """setup.py's PACKAGES, computed without running setup() (its module does at import)."""
    tree = _tree(ROOT / "setup.py")
    keep = [n for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id in ("SERVICE_PACKAGES", "PACKAGES") for t in n.targets)]
    namespace: dict[str, object] = {}
    exec("from setuptools import find_packages", namespace)  # our own setup.py
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)  # find_packages() walks relative paths
    try:
        exec(compile(ast.Module(body=keep, type_ignores=[]), "setup.py", "exec"), namespace)
        return list(namespace["PACKAGES"])  # type: ignore[call-overload]
    finally:
        os.chdir(cwd)


def test_setup_ships_exactly_the_top_level_packages_with_no_mapping() -> None:
    packages = _setup_packages()
    assert {p.split(".")[0] for p in packages} == set(TOP_PACKAGES)
    assert "package_dir" not in (ROOT / "setup.py").read_text()
    # Every package directory we parse is shipped, and every shipped one is where its name says.
    expected = {n for n, p in modules().items() if p.name == "__init__.py"}
    assert expected <= set(packages), sorted(expected - set(packages))
    for p in packages:
        init = ROOT.joinpath(*p.split(".")) / "__init__.py"
        assert init.is_file() or p == GENERATED, f"{p}: {init} missing"


# The shared vocabulary: what each module may import from the project (errors: nothing).
VOCABULARY = {"pdserve.errors": frozenset(), "pdserve.kv_layout": frozenset(),
              "pdserve.types": frozenset({"pdserve.errors"})}


@pytest.mark.parametrize("module", [*VOCABULARY, "pdserve.engine.block_manager",
                                    "pdserve.engine.scheduler"])
def test_torch_free_engine_core_imports_nothing_heavy(module: str) -> None:
    """The shared vocabulary imports only the error tree from the project, which imports
    nothing; the scheduler side stays torch-free."""
    graph = import_graph()
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    if module in VOCABULARY:
        assert graph[module] == VOCABULARY[module], graph[module]
    heavy = {"torch", "grpc", "ucxx"}
    for m in seen:
        for node in _module_level_imports(_tree(modules()[m]).body):
            for target in _imported_names(node, m):
                assert target.split(".")[0] not in heavy, f"{module} -> {m} imports {target}"
