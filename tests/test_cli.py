"""The command line's flag vocabulary (issue 12): help with defaults and a description for
every flag, --version, argparse errors for bad values, API keys from flags or the environment,
--model resolution (directory, .gguf, 'default', a Hugging Face id from the local cache),
`cluster up` passing engine flags on, and `pdserve health` against a real gRPC server.
Fast: no model is loaded and no cluster started."""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.cli import build_parser, main
from pdserve.cli_args import api_keys, engine_argv, served_name_default
from pdserve.cluster import api_keys_from_argv, api_keys_from_env
from pdserve.rpc import core_env

ROOT = Path(__file__).resolve().parent.parent


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                ) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _subparsers(sub, (*path, name))
    return out


COMMANDS = _subparsers(build_parser())


@pytest.fixture(autouse=True)
def _environ_restored() -> Iterator[None]:
    """`main()` sets process-wide UCX variables (UCXPY_ENABLE_PYTHON_FUTURE, ...) meant for a
    service process; in the test process they would switch later in-process ucxx users
    (tests/test_kvxfer.py) into another progress mode, which hung or crashed them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_every_command_is_listed() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"router", "prefill-worker", "decode-worker", "cluster up", "ask", "generate",
            "model pull", "health"} <= names


@pytest.mark.parametrize("path,parser", COMMANDS, ids=[" ".join(p) or "pdserve"
                                                        for p, _ in COMMANDS])
def test_every_flag_is_described_with_its_default(path: tuple[str, ...],
                                                  parser: argparse.ArgumentParser) -> None:
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        assert action.help, (path, action.option_strings or action.dest)
        if action.option_strings and action.default not in (None, [], False, argparse.SUPPRESS):
            assert "%(default)s" in formatter._get_help_string(action), \
                (path, action.option_strings)
    parser.format_help()  # every help string formats


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("pdserve ")


@pytest.mark.parametrize("operator", [None, "", "-event_engine_dns"])
def test_main_gives_grpc_its_settings_unless_the_operator_did(
        operator: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any command imports grpc, `main()` fills in `core_env.DEFAULTS`; a value the
    operator set (an empty one too) is left as it is."""
    for name in core_env.DEFAULTS:
        if operator is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, operator)
    with pytest.raises(SystemExit):
        main(["--version"])
    for name, value in core_env.DEFAULTS.items():
        assert os.environ[name] == (value if operator is None else operator)


@pytest.mark.parametrize("argv", [
    ["router", "--log-level", "loud"],
    ["decode-worker", "--log-level", "verbose"],
    ["cluster", "up", "--log-level", "x"],
    ["decode-worker", "--dtype", "float8"],
    ["decode-worker", "--kv-cache-mb", "0"],
    ["prefill-worker", "--threads", "many"],
    ["router", "--model", "/nonexistent/model.gguf"],
    ["router", "--model", "no-such-thing"],
])
def test_bad_values_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument" in err and "Traceback" not in err, err


def test_log_level_any_case_and_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_parser().parse_args(["router", "--log-level", "debug"]).log_level == "DEBUG"
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "warning")
    assert build_parser().parse_args(["router"]).log_level == "WARNING"


def test_bad_log_level_in_environment_is_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "router"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PDSERVE_LOG_LEVEL": "chatty"})
    assert proc.returncode == 2, proc.stderr
    assert "invalid log level 'chatty'" in proc.stderr and "KeyError" not in proc.stderr


# --------------------------------------------------------------------------- API keys


@pytest.mark.parametrize("command", [["router"], ["cluster", "up"]])
def test_api_keys_one_spelling(command: list[str]) -> None:
    parse = build_parser().parse_args
    args = parse([*command, "--api-key", "k1", "--api-key", "k2"])
    assert api_keys(args, env={}) == ["k1", "k2"]
    # The router's old comma list still works (hidden from help), alone or mixed.
    args = parse([*command, "--api-keys", "a, b", "--api-key", "c"])
    assert api_keys(args, env={}) == ["a", "b", "c"]


def test_api_keys_flags_win_over_environment() -> None:
    args = build_parser().parse_args(["router"])
    assert api_keys(args, env={"PDSERVE_API_KEY": "e1,e2 ,"}) == ["e1", "e2"]
    assert api_keys(args, env={"PDSERVE_API_KEYS": "old"}) == ["old"]
    assert api_keys(args, env={"PDSERVE_API_KEY": "new", "PDSERVE_API_KEYS": "old"}) == ["new"]
    assert api_keys(args, env={}) == []
    args = build_parser().parse_args(["router", "--api-key", "flag"])
    assert api_keys(args, env={"PDSERVE_API_KEY": "env"}) == ["flag"]


def test_deprecated_alias_is_hidden() -> None:
    for path, parser in COMMANDS:
        if path in (("router",), ("cluster", "up"), ("ask",)):
            text = parser.format_help()
            assert "--api-key KEY" in text and "--api-keys" not in text, path


def test_local_cluster_reads_keys_like_the_router() -> None:
    assert api_keys_from_argv(["--api-key", "a", "--api-keys=b,c", "--api-key=d"]) == \
        ["a", "b", "c", "d"]
    assert api_keys_from_argv(["--remote-threshold", "64"]) == []
    assert api_keys_from_env({"PDSERVE_API_KEYS": " x , y"}) == ["x", "y"]


def test_gateway_takes_the_same_key_flags() -> None:
    from pdserve.gateway.__main__ import _parser

    args = _parser().parse_args(["--api-key", "a", "--api-keys", "b,c", "--log-level", "info"])
    assert api_keys(args, env={}) == ["a", "b", "c"] and args.log_level == "INFO"


# --------------------------------------------------------------------------- model


def test_model_directory_gguf_and_default(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    assert parse(["router", "--model", "default"]).model == "default"
    assert parse(["router"]).model is None or isinstance(parse(["router"]).model, str)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert parse(["router", "--model", str(model)]).model == str(model)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    assert parse(["router", "--model", str(gguf)]).model == str(gguf)


def _fake_hub_cache(root: Path, repo: str) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<sha>}."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / sha
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(sha)
    return snapshot


def test_model_by_hugging_face_id_from_the_local_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = _fake_hub_cache(tmp_path, "acme/tiny-llm")
    args = build_parser().parse_args(["decode-worker", "--model", "acme/tiny-llm"])
    assert Path(args.model) == snapshot
    assert served_name_default(args.model) == "acme/tiny-llm"
    assert served_name_default("/models/tiny") is None
    # Absent from the cache: a usage error that says so; the hub is never asked.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--model", "acme/absent"])
    err = capsys.readouterr().err
    assert "not in the local cache" in err and "acme/absent" in err


# --------------------------------------------------------------------------- cluster up


def test_cluster_up_passes_engine_flags_to_workers() -> None:
    args = build_parser().parse_args(["cluster", "up", "--prefill", "2", "--decode", "3",
                                      "--dtype", "int8", "--threads", "2",
                                      "--kv-cache-mb", "256", "--max-num-batched-tokens",
                                      "1024"])
    assert (args.prefill, args.decode) == (2, 3)
    argv = engine_argv(args)
    worker = build_parser().parse_args(["decode-worker", *argv])
    assert (worker.dtype, worker.threads, worker.kv_cache_mb,
            worker.max_num_batched_tokens) == ("int8", 2, 256, 1024)
    # --threads unset: the cluster's own placement decides, so it is not forwarded.
    assert "--threads" not in engine_argv(build_parser().parse_args(["cluster", "up"]))


# --------------------------------------------------------------------------- health


def test_health_command_against_a_grpc_server() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        target = f"127.0.0.1:{port}"
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert main(["health", "--grpc", target]) == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        servicer.set("pdserve.v1.DecodeWorker", health_pb2.HealthCheckResponse.SERVING)
        assert main(["health", "--grpc", target]) == 0
        assert main(["health", "--grpc", target, "--service", "pdserve.v1.DecodeWorker"]) == 0
        assert main(["health", "--grpc", target, "--service", "nope"]) == 1
    finally:
        server.stop(0)
    assert main(["health", "--grpc", target, "--timeout", "0.5"]) == 1  # nobody listens


# --------------------------------------------------------------------------- layout


def _project_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("pdserve")}


def test_cli_modules_import_no_cycle() -> None:
    """cli -> cluster_cli -> services_cli -> cli_args -> cluster, never back."""
    order = ["cli", "cluster_cli", "services_cli", "cli_args", "cluster"]
    for i, name in enumerate(order):
        imports = _project_imports(ROOT / "pdserve" / f"{name}.py")
        for later in order[: i + 1]:
            assert f"pdserve.{later}" not in imports, (name, later)
    # The library below them imports only stdlib-only leaves (no project import of their own).
    leaves = {"pdserve.deathsig", "pdserve.settings"}
    assert {m.rsplit(".", 1)[0] if m.rsplit(".", 1)[0] in leaves else m
            for m in _project_imports(ROOT / "pdserve" / "cluster.py")} <= leaves
    for leaf in leaves:
        assert not _project_imports(ROOT / "pdserve" / f"{leaf.split('.')[1]}.py"), leaf


def test_ask_reports_an_unreachable_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["ask", "--url", f"http://127.0.0.1:{port}", "hi"]) == 1
    assert "pdserve ask:" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux threads only")
def test_cpus_and_nice_reach_threads_started_before() -> None:
    """A worker's --cpus and --nice hold for every thread it has, those an import started
    before the flags were applied included (Linux keeps both per thread)."""
    cpu = min(os.sched_getaffinity(0))
    code = f"""
import argparse, os, threading
from pdserve.services_cli import _place_process
stop = threading.Event()
early = threading.Thread(target=stop.wait)
early.start()
_place_process(argparse.Namespace(cpus={{{cpu}}}, nice=3))
late = threading.Thread(target=stop.wait)
late.start()
for tid in map(int, os.listdir("/proc/self/task")):
    print(tid, sorted(os.sched_getaffinity(tid)), os.getpriority(os.PRIO_PROCESS, tid))
stop.set()
"""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, check=True).stdout.split("\n")
    rows = [line.split(" ", 1)[1] for line in out if line]
    assert len(rows) == 3, out
    assert set(rows) == {f"[{cpu}] {before + 3}"}, rows
