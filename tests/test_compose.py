"""docker-compose.yml describes a topology that works: no Docker engine runs here, so the file
is validated against the Compose Specification schema (what Compose v2 reads) and against the
schema the legacy docker-compose 1.29.2 validates with (vendored in tests/data, Apache-2.0,
from the docker-compose 1.29.2 package), every service must have a healthcheck, every pdserve
service's command (and environment) is checked against the CLI, then started as a local
process with loopback addresses, free ports and a private Redis, and the router must become
healthy and answer a chat request."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdserve.services_cli import _advertise_host

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
SUBCOMMANDS = {"router", "prefill-worker", "decode-worker"}
PORT_FLAGS = ("--port", "--http-port", "--metrics-port")
pytestmark = pytest.mark.timeout(600)


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _services() -> dict[str, dict[str, Any]]:
    return _compose()["services"]


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}` / `${VAR:-default}` substitution, for running commands locally."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}",
                  lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def _pdserve_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in _services().items()
            if isinstance(svc.get("command"), list) and svc["command"][:1] == ["pdserve"]}


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _cli(argv: list[str]) -> list[str]:
    """A compose command (``pdserve ...``) as this interpreter runs it."""
    assert argv[0] == "pdserve"
    return [sys.executable, "-m", "pdserve.cli", *argv[1:]]


def test_compose_topology() -> None:
    services = _services()
    assert "redis" in services
    by_sub = {svc["command"][1]: name for name, svc in _pdserve_services().items()}
    assert set(by_sub) == SUBCOMMANDS, by_sub
    router = services[by_sub["router"]]
    assert "127.0.0.1:8000:8000" in router["ports"] and "127.0.0.1:50051:50051" in router["ports"]
    for name, svc in services.items():  # nothing is published on every interface (issue 11)
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
    for name, svc in _pdserve_services().items():
        argv = svc["command"]
        assert _flag(argv, "--redis-url") == "redis://redis:6379/0", name
        assert _flag(argv, "--host") == "0.0.0.0", name
        assert "redis" in svc.get("depends_on", {}), name
        assert svc.get("build") == ".", name
    assert (ROOT / "Dockerfile").is_file()
    assert "pdserve model pull" in (ROOT / "Dockerfile").read_text()


def test_compose_file_matches_the_compose_specification() -> None:
    """Compose v2 reads the Compose Specification; check-jsonschema vendors its schema."""
    from importlib.resources import files

    import jsonschema

    schema = json.loads((files("check_jsonschema.builtin_schemas.vendor")
                         / "compose-spec.json").read_text())
    jsonschema.validators.validator_for(schema)(schema).validate(_compose())


def test_compose_file_is_valid_for_docker_compose_1_29() -> None:
    """docker-compose 1.29 validates a file without `version:` against its own copy of the
    specification (Draft 4), which has no top-level `name:`."""
    import jsonschema

    schema = json.loads((ROOT / "tests" / "data" /
                         "docker-compose-1.29.2-compose_spec.json").read_text())
    config = _compose()
    assert "name" not in config and "version" not in config
    jsonschema.Draft4Validator(schema).validate(config)


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="no legacy docker-compose binary (pip install docker-compose==1.29.2)")
def test_compose_file_loads_in_legacy_docker_compose() -> None:
    proc = subprocess.run(["docker-compose", "-f", str(COMPOSE), "--profile", "observability",
                           "config", "--services"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) == set(_services())


def test_every_service_has_a_healthcheck() -> None:
    for name, svc in _services().items():
        check = svc.get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), name


@pytest.mark.parametrize("name", sorted(_pdserve_services()))
def test_healthcheck_commands_exist(name: str) -> None:
    test = _services()[name]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1:3] == ["pdserve", "health"], test
    proc = subprocess.run([*_cli(test[1:]), "--help"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for flag in (a for a in test[3:] if a.startswith("--")):
        assert flag in proc.stdout, (name, flag)
    port = _flag(_services()[name]["command"], "--port")
    target = _flag(test, "--grpc")
    if target is not None:  # a worker: the port it checks is the port it serves
        assert target.endswith(f":{port}"), (name, target)


def _seconds(value: str) -> float:
    return float(value.rstrip("s")) if value.endswith("s") else float(value)


def test_stop_grace_covers_drain() -> None:
    for name, svc in _pdserve_services().items():
        drain = _flag(svc["command"], "--drain-timeout")
        assert drain is not None, name
        assert _seconds(svc["stop_grace_period"]) > float(drain), name


def test_observability_profile() -> None:
    services = _services()
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"], name
        for volume in services[name]["volumes"]:
            host = volume.split(":")[0]
            assert (ROOT / host).exists(), (name, host)
    scrape = yaml.safe_load((ROOT / "deploy/observability/prometheus.yml").read_text())
    assert "router:8000" in json.dumps(scrape)


@pytest.mark.parametrize("name", sorted(_pdserve_services()))
def test_compose_command_exists(name: str) -> None:
    argv = _pdserve_services()[name]["command"]
    for cmd in (argv[:2], argv):  # the subcommand, then with every flag compose passes
        proc = subprocess.run([*_cli(cmd), "--help"], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 0, (cmd, proc.stderr[-2000:])
    help_text = proc.stdout
    for flag in (a for a in argv[2:] if a.startswith("--")):
        assert flag in help_text, (name, flag)


def test_wildcard_host_advertises_a_reachable_address() -> None:
    args = argparse.Namespace(host="0.0.0.0", advertise_host=None)
    host = _advertise_host(args)
    socket.inet_aton(host)  # an IPv4 address other containers can connect to
    assert host != "0.0.0.0"
    assert _advertise_host(argparse.Namespace(host="0.0.0.0", advertise_host="decode")) == \
        "decode"
    assert _advertise_host(argparse.Namespace(host="127.0.0.1", advertise_host=None)) == \
        "127.0.0.1"


# --------------------------------------------------------------------------- running it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _local_argv(argv: list[str], redis_url: str, namespace: str) -> tuple[list[str], dict]:
    """The compose command with loopback, free ports and our Redis; returns (argv, ports)."""
    out = list(argv)
    out[out.index("--redis-url") + 1] = redis_url
    out[out.index("--host") + 1] = "127.0.0.1"
    ports = {}
    for flag in PORT_FLAGS:
        if flag in out:
            ports[flag] = _free_port()
            out[out.index(flag) + 1] = str(ports[flag])
    # One thread each: this machine is small and shared.
    extra = ["--namespace", namespace]
    if argv[1] != "router":
        extra += ["--threads", "1"]
    return _cli(out) + extra, ports


@pytest.fixture(scope="module")
def compose_processes(redis_server: str, model_dir: Path, tmp_path_factory
                      ) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], dict, Path]]]:
    del model_dir  # the compose commands resolve the default model, which this pulls
    logs = tmp_path_factory.mktemp("compose")
    namespace = f"compose{uuid.uuid4().hex[:8]}"
    procs: dict[str, tuple[subprocess.Popen[bytes], dict, Path]] = {}
    try:
        for name, svc in _pdserve_services().items():
            argv, ports = _local_argv(svc["command"], redis_server, namespace)
            env = {**os.environ, **{k: _interpolate(str(v), dict(os.environ))
                                    for k, v in (svc.get("environment") or {}).items()}}
            log = logs / f"{name}.log"
            with log.open("wb") as f:
                proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                        cwd=ROOT)
            procs[name] = (proc, ports, log)
        yield procs
    finally:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _, _ in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def test_compose_commands_start_and_serve(compose_processes, prompt_ids) -> None:
    by_sub = {_pdserve_services()[n]["command"][1]: n for n in compose_processes}
    _, ports, _ = compose_processes[by_sub["router"]]
    url = f"http://127.0.0.1:{ports['--http-port']}"
    deadline = time.monotonic() + 300
    status = None
    while time.monotonic() < deadline:
        for name, (proc, _, log) in compose_processes.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}:\n"
                            f"{log.read_text()[-3000:]}")
        try:
            status = httpx.get(f"{url}/health", timeout=2).status_code
            workers = httpx.get(f"{url}/v1/pdserve/workers", timeout=2).json()["workers"]
            if status == 200 and {w["role"] for w in workers} == {"prefill", "decode"}:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        pytest.fail(f"router not healthy with both workers within 300s (last /health: {status})")

    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
        "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] >= 1

    # A prompt over the router's remote threshold is prefilled on the prefill worker and its
    # KV crosses over UCX with the transports the compose environment allows.
    threshold = int(_flag(_pdserve_services()[by_sub["router"]]["command"],
                          "--remote-threshold") or 256)
    ids = next(i for i in prompt_ids if len(i) > threshold)
    r = httpx.post(f"{url}/v1/completions", timeout=300, headers={"X-Pdserve-Timings": "1"},
                   json={"prompt": ids, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["pdserve"]["route"] == "remote"

    # Every process serves Prometheus metrics on the port compose gives it.
    assert httpx.get(f"{url}/metrics", timeout=5).status_code == 200
    for sub in ("prefill-worker", "decode-worker"):
        _, wports, _ = compose_processes[by_sub[sub]]
        text = httpx.get(f"http://127.0.0.1:{wports['--metrics-port']}/metrics", timeout=5).text
        assert "pdserve_engine_kv_blocks_total" in text, sub


# --------------------------------------------------------------------------- images


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_layers_and_cache_owner(dockerfile: str) -> None:
    """Dependencies are installed from pyproject.toml before any source is copied (editing
    code keeps the dependency layers), and the model cache is built by and owned by the user
    the containers run as."""
    lines = [ln.strip() for ln in (ROOT / dockerfile).read_text().splitlines()]

    def first(prefix: str) -> int:
        return next(i for i, ln in enumerate(lines) if ln.startswith(prefix))

    deps = first("COPY pyproject.toml")
    install = next(i for i, ln in enumerate(lines) if "requirements.txt" in ln and i > deps)
    assert install < first("COPY pdserve") < first("RUN pip install --no-deps")
    assert first("RUN pip install --index-url") < deps  # torch, the biggest layer, first
    assert first("USER pdserve") < first("RUN pdserve model pull")
    assert any("chown -R pdserve:pdserve /opt/pdserve" in ln for ln in lines)
    for ln in lines:
        if ln.startswith("COPY ") and not ln.startswith("COPY pyproject.toml"):
            src = ln.split()[1]
            assert (ROOT / src).exists(), ln


def test_cuda_dockerfile_has_cuda_torch_ucxx_and_optional_flash_attn() -> None:
    text = (ROOT / "Dockerfile.cuda").read_text()
    assert "download.pytorch.org/whl/${TORCH_CUDA}" in text and "ARG TORCH_CUDA=cu" in text
    assert "ARG FLASH_ATTN=0" in text and "flash-attn" in text
    assert any(d.startswith('"ucxx-cu12') for d in
               (ROOT / "pyproject.toml").read_text().split("dependencies = [", 1)[1]
               .split("]", 1)[0].split())
