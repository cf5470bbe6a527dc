"""One error table (pdserve.errors) for both APIs: every error maps the same way over gRPC
and over HTTP, and a client rebuilds the class the server raised."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import grpc
import pytest

from pdserve import errors
from pdserve.errors import (
    ERROR_CLASSES,
    CapacityError,
    EngineClosedError,
    ErrorCode,
    ErrorKind,
    InvalidRequestError,
    KVTransferError,
    ModelLoadError,
    PdserveError,
    PromptTooLongError,
    RequestAbortedError,
    kind_of,
    rebuild,
)
from pdserve.gateway.errors import from_pdserve
from pdserve.rpc.errors import status_for

# (exception, gRPC status, HTTP status)
CASES = [
    (InvalidRequestError("bad", param="prompt"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (PromptTooLongError("too long"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (CapacityError("busy"), grpc.StatusCode.UNAVAILABLE, 503),
    (CapacityError("pinned", code="kv_pending_limit"), grpc.StatusCode.UNAVAILABLE, 503),
    (EngineClosedError("engine is not running"), grpc.StatusCode.UNAVAILABLE, 503),
    (RequestAbortedError("aborted"), grpc.StatusCode.CANCELLED, 503),
    (KVTransferError("peer gone"), grpc.StatusCode.ABORTED, 500),
    (ModelLoadError("no weights"), grpc.StatusCode.INTERNAL, 500),
    # A stage timeout is retryable, never a 500 (issue 11).
    (PdserveError("decode worker sent nothing", code="decode_timeout"),
     grpc.StatusCode.UNAVAILABLE, 503),
]


@pytest.mark.parametrize(("exc", "status", "http"), CASES, ids=lambda c: getattr(c, "code", ""))
def test_every_error_maps_the_same_way_on_both_apis(exc: PdserveError, status: grpc.StatusCode,
                                                     http: int) -> None:
    assert status_for(exc)[0] == status
    api = from_pdserve(exc, retry_after_s=1)
    assert api.status == http and api.code == exc.code
    assert (http == 503) == ("Retry-After" in api.headers)
    kind = kind_of(exc)
    assert (kind.grpc_status_name, kind.http_status) == (status.name, http)


def test_registry_is_explicit_and_rebuilds_the_class() -> None:
    for code, cls in ERROR_CLASSES.items():
        assert issubclass(cls, PdserveError)
        assert cls.code == code or code == "engine_closed"
        rebuilt = rebuild(kind_of(cls("m")), code, "m", "p")
        assert type(rebuilt) is cls and rebuilt.code == code and rebuilt.param == "p"
    # A subclass defined elsewhere is not found by walking __subclasses__(): only the table
    # names classes, so a client never depends on what happens to be imported.
    class Local(CapacityError):
        code = "local_only"

    assert "local_only" not in ERROR_CLASSES
    assert type(rebuild(ErrorKind.UNAVAILABLE, "local_only", "m")) is CapacityError
    assert type(rebuild(ErrorKind.DEADLINE_EXCEEDED, "timeout", "m")) is TimeoutError


ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("pdserve", "router", "prefill_svc", "decode_svc", "kvxfer", "bench")


def test_error_codes_are_listed_once_and_read_as_their_wire_strings() -> None:
    values = [c.value for c in ErrorCode]
    assert len(values) == len(set(values))
    for c in ErrorCode:
        assert c.name == c.value.upper()
        # What goes into the pdserve-error-code trailer, an HTTP body and a kvxfer frame.
        assert str(c) == f"{c}" == c.value and json.dumps(c) == json.dumps(c.value)
    assert ErrorCode.OVERLOADED == "overloaded" and ErrorCode("kv_timeout") is ErrorCode.KV_TIMEOUT


def test_the_whole_tree_lives_in_pdserve_errors_with_listed_codes() -> None:
    tree = [v for v in vars(errors).values()
            if isinstance(v, type) and issubclass(v, PdserveError)]
    assert len(tree) >= 15
    for cls in tree:
        assert cls.__module__ == "pdserve.errors"
        assert isinstance(cls.code, ErrorCode), cls


def _bare_codes(path: Path) -> list[str]:
    """Where a module spells an error code as a string literal: a `code=` argument or
    default, or a class's `code = ...`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        values: list[ast.expr | None] = []
        if isinstance(node, ast.keyword) and node.arg == "code":
            values.append(node.value)
        elif isinstance(node, ast.ClassDef):
            values += [a.value for a in node.body if isinstance(a, ast.Assign | ast.AnnAssign)
                       and any(isinstance(t, ast.Name) and t.id == "code"
                               for t in (a.targets if isinstance(a, ast.Assign) else [a.target]))]
        elif isinstance(node, ast.arguments):
            positional = [*node.posonlyargs, *node.args]
            named = positional[len(positional) - len(node.defaults):]
            values += [d for a, d in [*zip(named, node.defaults, strict=True),
                                      *zip(node.kwonlyargs, node.kw_defaults, strict=True)]
                       if a.arg == "code"]
        for value in values:  # the value itself, or either branch of a conditional
            branches = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
            found += [f"{path.relative_to(ROOT)}:{b.lineno}: {b.value!r}" for b in branches
                      if isinstance(b, ast.Constant) and isinstance(b.value, str)]
    return found


def test_raise_sites_name_error_codes_by_their_enum_member() -> None:
    paths = [p for top in RUNTIME for p in sorted((ROOT / top).rglob("*.py"))
             if "v1" not in p.relative_to(ROOT).parts]
    bare = [hit for p in paths for hit in _bare_codes(p)]
    assert not bare, "spell these as ErrorCode members:\n" + "\n".join(bare)


def test_every_module_imports_the_errors_from_pdserve_errors() -> None:
    """No module re-exports them (`from pdserve.types import InvalidRequestError` fails)."""
    names = {n for n, v in vars(errors).items() if isinstance(v, type) and v.__module__ ==
             "pdserve.errors"}
    wrong = []
    for top in (*RUNTIME, "tests", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module != "pdserve.errors":
                    wrong += [f"{path.relative_to(ROOT)}:{node.lineno}: {a.name} from "
                              f"{node.module}" for a in node.names if a.name in names]
    assert not wrong, "\n".join(wrong)
