"""docker-compose.yml describes a topology that works: no Docker engine runs here, so the file
is validated against the Compose Specification schema (what Compose v2 reads) and against the
schema the legacy docker-compose 1.29.2 validates with (vendored in tests/data, Apache-2.0,
from the docker-compose 1.29.2 package), every service must have a healthcheck, every pdserve
service's command (and environment) is checked against the CLI, then started as a local
process with loopback addresses, free ports and the compose file's own (password-protected)
Redis command, and the router must become healthy and answer a chat request.

Fail closed (issue 21): the cluster secret, the API keys and the Redis password are required
variables (`${VAR:?message}`), so `up` refuses to start without them; no secret is on a
command line."""

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

from pdserve.cluster import free_port
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


class MissingVariable(ValueError):
    """A required variable (`${VAR:?message}`) is unset or empty: compose refuses to start."""


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's substitution, for running commands locally: `$$` (a literal `$`),
    `${VAR}`, `${VAR:-default}` / `${VAR-default}` and the required `${VAR:?message}` /
    `${VAR?message}` (MissingVariable when unset, or empty with the colon)."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, colon, op, arg = m.group(1), m.group(2), m.group(3), m.group(4) or ""
        have = env.get(name)
        missing = have is None or (colon and have == "")
        if op == "?":
            if missing:
                raise MissingVariable(f"{name}: {arg}")
            return str(have)
        return arg if op == "-" and missing else (have or "")
    return re.sub(r"\$\$|\$\{(\w+)(?:(:?)([-?])([^}]*))?\}", one, value)


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
        assert "--redis-url" not in argv and "--insecure" not in argv, name
        assert re.fullmatch(r"redis://:\$\{PDSERVE_REDIS_PASSWORD:\?[^}]+\}@redis:6379/0",
                            svc["environment"]["PDSERVE_REDIS_URL"]), name
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
    return free_port()  # below the ephemeral range (pdserve.cluster.free_port)


def _local_argv(argv: list[str], namespace: str) -> tuple[list[str], dict]:
    """The compose command with loopback and free ports; returns (argv, ports)."""
    out = list(argv)
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


# What an operator puts in the environment of `docker compose up`.
COMPOSE_ENV = {"PDSERVE_CLUSTER_SECRET": f"compose-cluster-secret-{uuid.uuid4().hex}",
               "PDSERVE_API_KEY": f"sk-compose-{uuid.uuid4().hex[:12]}",
               "PDSERVE_REDIS_PASSWORD": uuid.uuid4().hex}
SECRET_VARIABLES = tuple(COMPOSE_ENV)


def _service_env(svc: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    return {k: _interpolate(str(v), env) for k, v in (svc.get("environment") or {}).items()}


def test_compose_refuses_to_start_open() -> None:
    """Each secret is a required variable wherever it is used: without it (unset or empty),
    interpolating the file fails as `docker compose up` does, naming the variable."""
    used: dict[str, set[str]] = {v: set() for v in SECRET_VARIABLES}
    for name, svc in _services().items():
        for key, value in (svc.get("environment") or {}).items():
            for var in SECRET_VARIABLES:
                if var in str(value):
                    assert re.search(r"\$\{" + var + r":\?[^}]+\}", str(value)), (name, key)
                    used[var].add(name)
        for arg in svc.get("command") or []:  # never on a command line
            assert not any(var in str(arg) for var in SECRET_VARIABLES), (name, arg)
    assert used["PDSERVE_CLUSTER_SECRET"] >= set(_pdserve_services())
    assert "router" in used["PDSERVE_API_KEY"]
    assert used["PDSERVE_REDIS_PASSWORD"] >= {"redis", *_pdserve_services()}
    for var in SECRET_VARIABLES:
        for env in ({k: v for k, v in COMPOSE_ENV.items() if k != var},
                    {**COMPOSE_ENV, var: ""}):
            with pytest.raises(MissingVariable, match=var):
                for svc in _services().values():
                    _service_env(svc, env)
    for svc in _services().values():  # with all three, everything interpolates
        _service_env(svc, COMPOSE_ENV)


def _compose_redis_script(workdir: Path, port: int) -> tuple[str, dict[str, str]]:
    """The compose file's Redis command as a local shell script (its /tmp a private
    directory, a free loopback port) and its environment."""
    redis = _services()["redis"]
    assert redis["command"][:2] == ["sh", "-c"]
    script = (_interpolate(redis["command"][2], {}).replace("/tmp/", f"{workdir}/")
              + f" --port {port} --bind 127.0.0.1")
    return script, {**os.environ, **_service_env(redis, COMPOSE_ENV)}


@pytest.fixture(scope="module")
def compose_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = _free_port()
    script, env = _compose_redis_script(tmp_path_factory.mktemp("compose-redis"), port)
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _redis_answer(port, b"PING\r\n"):
            assert proc.poll() is None and time.monotonic() < deadline, "redis did not start"
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _redis_answer(port: int, command: bytes) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(command)
            return s.recv(256)
    except OSError:
        return b""


def test_compose_redis_wants_its_password(compose_redis: int) -> None:
    assert _redis_answer(compose_redis, b"PING\r\n").startswith(b"-NOAUTH")
    password = COMPOSE_ENV["PDSERVE_REDIS_PASSWORD"]
    assert _redis_answer(compose_redis, f"AUTH {password}\r\n".encode()) == b"+OK\r\n"
    probe = _services()["redis"]["healthcheck"]["test"]
    assert probe[0] == "CMD-SHELL"
    env = {**os.environ, **_service_env(_services()["redis"], COMPOSE_ENV)}
    cmd = probe[1].replace("redis-cli", f"redis-cli -p {compose_redis}")
    assert subprocess.run(["sh", "-c", cmd], env=env, timeout=10).returncode == 0
    env["REDISCLI_AUTH"] = "wrong"
    assert subprocess.run(["sh", "-c", cmd], env=env, timeout=10,
                          capture_output=True).returncode != 0


@pytest.fixture(scope="module")
def compose_processes(compose_redis: int, model_dir: Path, tmp_path_factory
                      ) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], dict, Path]]]:
    del model_dir  # the compose commands resolve the default model, which this pulls
    logs = tmp_path_factory.mktemp("compose")
    namespace = f"compose{uuid.uuid4().hex[:8]}"
    procs: dict[str, tuple[subprocess.Popen[bytes], dict, Path]] = {}
    try:
        for name, svc in _pdserve_services().items():
            argv, ports = _local_argv(svc["command"], namespace)
            if svc["command"][1] == "router":
                # Threshold placement, so the test knows a long prompt's route: cost
                # placement (the default) prefills a cold prompt where it is cheapest, and
                # with every process on this host's CPUs that is the decode worker.
                argv += ["--placement", "threshold"]
            service_env = _service_env(svc, COMPOSE_ENV)
            service_env["PDSERVE_REDIS_URL"] = service_env["PDSERVE_REDIS_URL"].replace(
                "@redis:6379/", f"@127.0.0.1:{compose_redis}/")
            env = {k: v for k, v in os.environ.items()
                   if k not in ("PDSERVE_API_KEY", "PDSERVE_API_KEYS")}
            env.update(service_env)
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
    auth = {"Authorization": f"Bearer {COMPOSE_ENV['PDSERVE_API_KEY']}"}
    deadline = time.monotonic() + 300
    status = None
    while time.monotonic() < deadline:
        for name, (proc, _, log) in compose_processes.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}:\n"
                            f"{log.read_text()[-3000:]}")
        try:
            status = httpx.get(f"{url}/health", timeout=2).status_code
            workers = httpx.get(f"{url}/v1/pdserve/workers", headers=auth,
                                timeout=2).json()["workers"]
            if status == 200 and {w["role"] for w in workers} == {"prefill", "decode"}:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        pytest.fail(f"router not healthy with both workers within 300s (last /health: {status})")

    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
            "temperature": 0}
    assert httpx.post(f"{url}/v1/chat/completions", timeout=120, json=body).status_code == 401
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json=body, headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] >= 1

    # A prompt over the router's remote threshold is prefilled on the prefill worker and its
    # KV crosses over UCX with the transports the compose environment allows.
    threshold = int(_flag(_pdserve_services()[by_sub["router"]]["command"],
                          "--remote-threshold") or 256)
    ids = next(i for i in prompt_ids if len(i) > threshold)
    r = httpx.post(f"{url}/v1/completions", timeout=300,
                   headers={"X-Pdserve-Timings": "1", **auth},
                   json={"prompt": ids, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["pdserve"]["route"] == "remote"

    # Every process serves Prometheus metrics on the port compose gives it.
    assert httpx.get(f"{url}/metrics", timeout=5).status_code == 200
    for sub in ("prefill-worker", "decode-worker"):
        _, wports, _ = compose_processes[by_sub[sub]]
        text = httpx.get(f"http://127.0.0.1:{wports['--metrics-port']}/metrics", timeout=5).text
        assert "pdserve_engine_kv_blocks_total" in text, sub

    # No secret on any process's command line, nor in its log.
    for name, (proc, _, log) in compose_processes.items():
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
        text = log.read_text(errors="replace")
        for var, value in COMPOSE_ENV.items():
            assert value not in argv, (name, var)
            assert value not in text, (name, var)


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
