"""Fail closed (issue 21, items 3 and 6), on real processes.

- Every command that listens (router, workers, `cluster up`, the colocated gateway) refuses
  to bind an address off loopback without API keys (where it serves the client API) and a
  cluster secret, naming what is missing and `--insecure`, before it loads or binds
  anything; with `--insecure` it starts and says so loudly.
- A cluster secret file its group or others may read is refused, and so is a guessable
  secret (file or environment), without quoting it.
- `cluster up` off loopback with an API key starts; its `ready:` line shows the Redis URL
  without the password, and no child has the Redis URL on its command line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cli_args import (
    API_KEYS_NEEDED,
    CLUSTER_SECRET_NEEDED,
    exposure_problem,
    is_loopback,
    missing_credentials,
)
from pdserve.cluster import free_port, redact_url, wait_port
from pdserve.rpc.auth import ClusterSecret, load_cluster_secret, secret_weakness
from tests.helpers.cluster_util import ClusterUp

pytestmark = pytest.mark.timeout(600)

CLI = [sys.executable, "-m", "pdserve.cli"]
GOOD_SECRET = "3f9c2b7e41d85a06c1e9f0b24d7a6e58"  # 32 hex characters: about 113 bits
CREDENTIAL_ENV = ("PDSERVE_API_KEY", "PDSERVE_API_KEYS", "PDSERVE_CLUSTER_SECRET",
                  "PDSERVE_REDIS_URL")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIAL_ENV}
    return {**env, **extra}


# --------------------------------------------------------------------------- the rule


def test_loopback_and_exposed_hosts() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.5", "192.168.1.2", "fe80::1", "example.com",
                 "my-host"):
        assert not is_loopback(host), host


def test_exposure_problem_names_what_is_missing() -> None:
    secret = ClusterSecret(GOOD_SECRET.encode())
    both = missing_credentials(api_keys=[], secret=None)
    assert both == [API_KEYS_NEEDED, CLUSTER_SECRET_NEEDED]
    assert missing_credentials(api_keys=["k"], secret=secret) == []
    assert missing_credentials(secret=None) == [CLUSTER_SECRET_NEEDED]  # a worker: no keys
    assert missing_credentials(api_keys=[], needs_secret=False) == [API_KEYS_NEEDED]
    problem = exposure_problem("0.0.0.0", both, insecure=False)
    assert problem and "--insecure" in problem and "API keys" in problem
    assert exposure_problem("127.0.0.1", both, insecure=False) is None  # loopback: open
    assert exposure_problem("0.0.0.0", both, insecure=True) is None  # told to
    assert exposure_problem("0.0.0.0", [], insecure=False) is None  # every credential


# --------------------------------------------------------------------------- the secret


def _secret_file(tmp_path: Path, text: str, mode: int) -> Path:
    path = tmp_path / f"secret-{mode:o}"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602, 0o620])
def test_secret_file_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = _secret_file(tmp_path, GOOD_SECRET, mode)
    with pytest.raises(ValueError, match="chmod 600") as refused:
        load_cluster_secret(path, env={})
    assert GOOD_SECRET not in str(refused.value)


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_private_secret_file_is_read(tmp_path: Path, mode: int) -> None:
    secret = load_cluster_secret(_secret_file(tmp_path, GOOD_SECRET, mode), env={})
    assert secret is not None and secret.value == GOOD_SECRET.encode()


def test_secret_file_problems(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        load_cluster_secret(_secret_file(tmp_path, "  ", 0o600), env={})
    with pytest.raises(ValueError, match="cannot read"):
        load_cluster_secret(tmp_path / "absent", env={})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ValueError, match="not a regular file"):
        load_cluster_secret(fifo, env={})


@pytest.mark.parametrize("weak", [
    "short-secret",  # < 16 characters
    "a" * 64,  # one character
    "passwordpassword",  # 7 distinct characters
    "abcdefghabcdefgh",  # 8 distinct, 48 bits by the estimate
])
def test_weak_secrets_are_refused(tmp_path: Path, weak: str) -> None:
    """Weak in a file or in the environment; the message never quotes the secret."""
    assert secret_weakness(weak)
    for load in (lambda: load_cluster_secret(_secret_file(tmp_path, weak, 0o600), env={}),
                 lambda: load_cluster_secret(env={"PDSERVE_CLUSTER_SECRET": weak})):
        with pytest.raises(ValueError, match="openssl rand") as refused:
            load()
        assert weak not in str(refused.value)


def test_entropy_boundary() -> None:
    assert secret_weakness("0123456789abcdef") is None  # 16 distinct characters: 64 bits
    assert secret_weakness("aabbccddeeffgghh1122") is None  # 66 bits
    assert "entropy" in (secret_weakness("aabbccddeeffgghh") or "")  # 48 bits


def test_generated_secrets_pass() -> None:
    import secrets

    from pdserve.cluster import new_cluster_secret

    for _ in range(200):
        assert secret_weakness(new_cluster_secret()) is None
        assert secret_weakness(secrets.token_hex(32)) is None  # `openssl rand -hex 32`
        assert secret_weakness(secrets.token_hex(16)) is None  # `openssl rand -hex 16`


def test_redact_url() -> None:
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://user:pw@h:6379/0") == "redis://***:***@h:6379/0"
    assert redact_url("rediss://:p%40w@[::1]:6379/0?ssl_ca_certs=/ca.pem") == \
        "rediss://:***@[::1]:6379/0?ssl_ca_certs=/ca.pem"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


# --------------------------------------------------------------------------- processes


def _refused(argv: list[str], env: dict[str, str]) -> str:
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0, (argv, proc.stderr[-2000:])
    assert "refusing to listen on" in proc.stderr and "--insecure" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert time.monotonic() - started < 60  # before any model or Redis
    return proc.stderr


@pytest.mark.parametrize("argv, env, missing", [
    (["router", "--host", "0.0.0.0"], {}, ("API keys", "cluster secret")),
    (["router", "--host", "0.0.0.0"], {"PDSERVE_CLUSTER_SECRET": GOOD_SECRET},
     ("API keys",)),
    (["router", "--host", "::"], {"PDSERVE_API_KEY": "sk-only"}, ("cluster secret",)),
    (["router", "--host", "10.11.12.13"], {"PDSERVE_API_KEY": " , "},  # empty list: no key
     ("API keys", "cluster secret")),
    (["decode-worker", "--host", "0.0.0.0"], {"PDSERVE_API_KEY": "sk-irrelevant"},
     ("cluster secret",)),
    (["prefill-worker", "--host", "::"], {}, ("cluster secret",)),
])
def test_listeners_off_loopback_refuse_without_credentials(
        argv: list[str], env: dict[str, str], missing: tuple[str, ...]) -> None:
    stderr = _refused([*CLI, *argv], _env(**env))
    for what in ("API keys", "cluster secret"):
        assert (what in stderr) == (what in missing), (what, stderr)


def test_cluster_up_off_loopback_without_api_keys_refuses() -> None:
    stderr = _refused([*CLI, "cluster", "up", "--host", "0.0.0.0"], _env())
    assert "API keys" in stderr
    assert "starting cluster" not in stderr  # nothing was started: no Redis, no child


def test_colocated_gateway_off_loopback_without_api_keys_refuses() -> None:
    _refused([sys.executable, "-m", "pdserve.gateway", "--host", "0.0.0.0"], _env())


def test_world_readable_secret_file_stops_a_worker(tmp_path: Path) -> None:
    path = _secret_file(tmp_path, GOOD_SECRET, 0o644)
    proc = subprocess.run([*CLI, "decode-worker", "--cluster-secret-file", str(path)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode != 0
    assert "chmod 600" in proc.stderr and GOOD_SECRET not in proc.stderr, proc.stderr


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


def test_insecure_router_starts_with_a_loud_warning(redis_server: str, model_dir: Path,
                                                     tmp_path: Path) -> None:
    """`--insecure` off loopback: it serves, and its log says INSECURE_LISTENER (plus the
    usual warnings that API keys and the cluster secret are off)."""
    http_port = free_port()
    log = tmp_path / "router.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*CLI, "router", "--host", "0.0.0.0", "--insecure", "--model", str(model_dir),
             "--namespace", f"insecure{os.getpid()}", "--port", str(free_port()),
             "--http-port", str(http_port)], stdout=out, stderr=subprocess.STDOUT, text=True,
            env=_env(PDSERVE_REDIS_URL=redis_server))
    try:
        wait_port(http_port, proc, 120, "router")  # type: ignore[arg-type]
    finally:
        _stop(proc)
    text = log.read_text()
    for event in ("INSECURE_LISTENER", "api_auth_disabled", "cluster_auth_disabled"):
        assert f'"event": "{event}"' in text, (event, text[-3000:])
    assert '"level": "warning"' in text


def test_cluster_up_off_loopback_with_an_api_key(model_dir: Path) -> None:
    """Starts (the cluster secret is its own, the key comes from the environment); the
    `ready:` line and the children's command lines carry no Redis password, and its private
    Redis wants one."""
    http_port = free_port()
    up = ClusterUp(
        [*CLI, "cluster", "up", "--host", "0.0.0.0", "--prefill", "0", "--decode", "0",
         "--model", str(model_dir), "--http-port", str(http_port), "--port", str(free_port()),
         "--ready-timeout", "120"], _env(PDSERVE_API_KEY="sk-fail-closed-test"))
    proc, seen = up.proc, up.seen
    try:
        ready = up.wait_ready(180)
        assert "redis redis://:***@127.0.0.1:" in ready, ready
        children = _children(proc.pid)
        assert any("redis-server" in argv for argv in children.values()), children
        router = next(argv for argv in children.values() if " router " in argv)
        assert "--host 0.0.0.0" in router and "--redis-url" not in router, router
        pid = next(p for p, argv in children.items() if " router " in argv)
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        url = next(e for e in env if e.startswith(b"PDSERVE_REDIS_URL=")).decode()
        password = url.split("://:", 1)[1].split("@", 1)[0]
        assert len(password) >= 32
        for argv in children.values():
            assert password not in argv and "redis://" not in argv, argv
        assert password not in "".join(seen)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        _assert_redis_wants_a_password(port)
    finally:
        code = _stop(proc)
    assert code == 0, "".join(seen)


def _assert_redis_wants_a_password(port: int) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(128).startswith(b"-NOAUTH"), "the private Redis answered without a password"


def _children(pid: int) -> dict[int, str]:
    """Direct children of `pid` -> their command lines (spaces between arguments)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(
                    b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    return out
