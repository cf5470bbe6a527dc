"""`LocalCluster`: Redis, a router and N prefill + M decode workers as child processes on
127.0.0.1 -- what `pdserve cluster up`, the cluster tests and the benchmarks start.

No secret goes on a child's command line (`ps` shows those to every user of the machine):
the cluster secret, the API keys and the Redis URL (it may carry a password) travel in the
children's environment; the private Redis reads its password from a mode-600 config file.

A library module: it imports nothing from the CLI, and runs each process through
``python -m pdserve.cli`` so every flag it passes is one the CLI documents.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pdserve.deathsig import guarded

API_KEY_ENV = "PDSERVE_API_KEY"  # comma-separated keys
CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"  # pdserve.rpc.auth reads it
LEGACY_API_KEY_ENV = "PDSERVE_API_KEYS"  # the older spelling, still read
REDIS_URL_ENV = "PDSERVE_REDIS_URL"  # `--redis-url`'s default; may carry a password


def redact_url(url: str) -> str:
    """`url` with its password (and a user's name) replaced by ``***``, for logs and
    messages: ``redis://:pw@host:6379/0`` -> ``redis://:***@host:6379/0``."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = "***" if parts.username else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def split_keys(values: Iterable[str]) -> list[str]:
    """Comma lists and repeated values -> keys, whitespace stripped, empties and repeats
    dropped, order kept (the first is the one clients send)."""
    keys: list[str] = []
    for value in values:
        for key in (k.strip() for k in value.split(",")):
            if key and key not in keys:
                keys.append(key)
    return keys


def api_keys_from_env(env: Mapping[str, str]) -> list[str]:
    """Keys from PDSERVE_API_KEY, else PDSERVE_API_KEYS (both comma lists)."""
    return split_keys([env.get(API_KEY_ENV) or env.get(LEGACY_API_KEY_ENV, "")])


def api_keys_from_argv(argv: Iterable[str]) -> list[str]:
    """Keys given to a router or gateway command line (`--api-key K`, repeatable, or the
    deprecated comma list `--api-keys K1,K2`)."""
    args, values = list(argv), []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--api-key", "--api-keys"):
            if eq:
                values.append(value)
            elif i + 1 < len(args):
                values.append(args[i + 1])
    return split_keys(values)


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_PICKED_FLOOR = 10000


# Every port free_port handed out in this process. None is handed out twice: a port picked
# for a child that has not bound it yet is still free, and picked again (1 in ~22,000 per
# pair, ~7 ports a cluster, dozens of clusters a test run) the two children raced for it and
# the slower one, a worker loading its model, exited with "Address already in use".
_given: set[int] = set()
_given_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a child to bind later. Taken below the kernel's
    ephemeral range where there is room: a port picked there could be handed to any socket
    of any process (UCX's listeners and connections on lo, clients) before the child binds
    it, and the child would fail with "Address already in use"."""
    lo, _ = _ephemeral_range()
    with _given_lock:
        if lo - _PICKED_FLOOR >= 1000:
            rng = random.SystemRandom()
            for _ in range(64):
                port = rng.randrange(_PICKED_FLOOR, lo)
                if port not in _given and _bindable(host, port):
                    _given.add(port)
                    return port
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _given:
                _given.add(port)
                return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


_LOG_TAIL_LINES = 25


def exited_error(what: str, proc: subprocess.Popen[bytes], log: Path | None) -> RuntimeError:
    """The error for a child that exited while starting: its code, and the end of its log
    (where it said why), so a test run's report says it without the log directory."""
    if log is None:
        return RuntimeError(f"{what} exited with code {proc.returncode} while starting")
    try:
        tail = log.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    except OSError as exc:
        tail = [f"(its log could not be read: {exc})"]
    return RuntimeError(f"{what} exited with code {proc.returncode} while starting; the end "
                        f"of {log}:\n" + "\n".join(tail))


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float, what: str,
              log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise exited_error(what, proc, log)
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not open port {port} within {timeout_s:.0f}s")


# The nice value `cluster up` gives prefill workers, which share every CPU with the decode
# workers (--prefill-nice): what they publish (`WorkerInfo.nice`), and bench.sim models.
DEFAULT_PREFILL_NICE = 5


class LocalCluster:
    """Redis (private unless a URL is given), router, N prefill and M decode workers, as
    child processes listening on `host` (127.0.0.1; a process refuses any other address
    without API keys and a cluster secret unless ``--insecure`` is in its arguments). Use as
    a context manager; stops everything on exit.

    The private Redis binds 127.0.0.1 and requires a random password (`redis_url` carries
    it; children get it as ``PDSERVE_REDIS_URL`` in their environment, never as
    ``--redis-url``).

    Every child is started with PR_SET_PDEATHSIG (SIGTERM): if the process that started them
    dies, even by SIGKILL, they drain and exit rather than outlive it. (The signal follows
    the *thread* that spawned them: start the cluster from a thread that lives as long.)

    Every child gets the cluster secret in its environment (``PDSERVE_CLUSTER_SECRET``, never
    on its command line): `cluster_secret` (`new_cluster_secret()` makes one; ``""``: none),
    else the one in `env` / this process's environment, else none (internal calls are then
    not authenticated, and every process warns about it). `pdserve cluster up` always has
    one. To call a worker directly, send
    ``pdserve.rpc.auth.ClusterSecret(secret.encode()).grpc_metadata()``.

    With ``tls=True`` every hop is TLS: a private CA and a certificate per process kind
    (router, prefill, decode, client) are made in ``log_dir/tls`` (`pdserve certs`, mode
    600), each child gets the paths of its own (``--tls-cert/--tls-key/--tls-ca``: paths,
    never key material, on its command line), the router serves HTTPS and gRPC over TLS and
    dials the workers with mTLS, which refuse any client without a certificate from that
    CA. Callers use `tls_files()` (the client certificate's cert, key and CA paths),
    `grpc_credentials()` and `http_verify()`."""

    def __init__(self, *, prefill: int = 1, decode: int = 1, redis_url: str | None = None,
                 model: str | None = None, http_port: int = 0, grpc_port: int = 0,
                 extra_worker_args: tuple[str, ...] = (), router_args: tuple[str, ...] = (),
                 extra_prefill_args: tuple[str, ...] = (),
                 extra_decode_args: tuple[str, ...] = (), log_dir: Path | None = None,
                 namespace: str | None = None, env: dict[str, str] | None = None,
                 place_workers: bool = True, prefill_nice: int = DEFAULT_PREFILL_NICE,
                 cluster_secret: str | None = None, host: str = "127.0.0.1",
                 tls: bool = False):
        self.host = host
        self.n_prefill, self.n_decode = prefill, decode
        self.place_workers, self.prefill_nice = place_workers, prefill_nice
        self.redis_url = redis_url
        self.model = model
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.extra = extra_worker_args
        self.extra_by_role = {"prefill": extra_prefill_args, "decode": extra_decode_args}
        self.router_args = router_args
        self.ports: dict[str, int] = {}  # worker name -> gRPC port
        self.metrics_ports: dict[str, int] = {}  # worker name -> Prometheus HTTP port
        self.namespace = namespace or f"cluster{uuid.uuid4().hex[:8]}"
        # absolute: processes started with it as their working directory are handed paths in it
        self.log_dir = (log_dir or Path(tempfile.mkdtemp(prefix="pdserve-cluster-"))).absolute()
        self.tls_dir: Path | None = None
        if tls:
            self.tls_dir = self.log_dir / "tls"
            hosts = [] if host in ("127.0.0.1", "localhost") else ["--host", host]
            subprocess.run([sys.executable, "-m", "pdserve.cli", "certs", "--out",
                            str(self.tls_dir), *hosts], check=True, timeout=120,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Unbuffered: a child that crashes leaves its last log lines behind.
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if cluster_secret is None:
            cluster_secret = self.env.get(CLUSTER_SECRET_ENV, "")
        if cluster_secret:
            self.env[CLUSTER_SECRET_ENV] = cluster_secret
        else:
            self.env.pop(CLUSTER_SECRET_ENV, None)
        self.cluster_secret = cluster_secret
        if redis_url:
            self.env[REDIS_URL_ENV] = redis_url
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._redis: subprocess.Popen[bytes] | None = None

    @property
    def scheme(self) -> str:
        return "http" if self.tls_dir is None else "https"

    @property
    def http_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def metrics_url(self, name: str) -> str:
        """Prometheus endpoint of a worker (the router's is ``{http_url}/metrics``)."""
        return f"{self.scheme}://127.0.0.1:{self.metrics_ports[name]}/metrics"

    def tls_files(self, name: str = "client") -> tuple[Path, Path, Path] | None:
        """(certificate, key, CA) of the cluster's certificate `name` (``client`` for
        callers), or None without TLS; `pdserve.rpc.tls.load_tls(*files)` reads them."""
        if self.tls_dir is None:
            return None
        d = self.tls_dir
        return d / f"{name}.crt", d / f"{name}.key", d / "ca.crt"

    def grpc_credentials(self) -> Any:
        """gRPC channel credentials with the client certificate (None without TLS)."""
        files = self.tls_files()
        if files is None:
            return None
        import grpc

        cert, key, ca = (f.read_bytes() for f in files)
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def http_verify(self) -> Any:
        """httpx's ``verify=`` for this cluster's HTTP(S) endpoints: an `ssl.SSLContext`
        trusting the cluster's CA and presenting the client certificate, else True."""
        files = self.tls_files()
        if files is None:
            return True
        import ssl

        cert, key, ca = files
        ctx = ssl.create_default_context(cafile=str(ca))
        ctx.load_cert_chain(cert, key)
        return ctx

    def _tls_args(self, name: str) -> list[str]:
        """The TLS flags of a child whose certificate is `name` (none without TLS)."""
        if self.tls_dir is None:
            return []
        d = self.tls_dir
        return ["--tls-cert", str(d / f"{name}.crt"), "--tls-key", str(d / f"{name}.key"),
                "--tls-ca", str(d / "ca.crt")]

    def _log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        # The child gets its own copy of the descriptor; ours is closed once it is started.
        with open(self._log(name), "wb") as log:
            proc = subprocess.Popen(guarded(argv), stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env)
        self.procs[name] = proc
        return proc

    def _pdserve(self, *args: str) -> list[str]:
        # The Redis URL is in self.env (start_redis / start), not here: it may hold a password.
        base = [sys.executable, "-m", "pdserve.cli", *args, "--namespace", self.namespace,
                "--host", self.host]
        return base + (["--model", self.model] if self.model else [])

    def start_redis(self) -> None:
        """Start the private Redis unless a URL was given; either way the children will find
        the URL in their environment."""
        if not self.redis_url:
            self.redis_url = self._start_private_redis()
        self.env[REDIS_URL_ENV] = self.redis_url

    def _start_private_redis(self) -> str:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found; install it or pass --redis-url")
        port, password = free_port(), secrets.token_hex(24)
        config = self.log_dir / "redis.conf"
        # The password goes in a file only this user can read, not on redis' command line.
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'port {port}\nbind 127.0.0.1\nsave ""\nappendonly no\n'
                    f"requirepass {password}\n")
        # In a process group of its own: a Ctrl-C in the terminal signals the whole foreground
        # group at once, and Redis, which exits on SIGINT at once, would be gone while the
        # workers drain (deregister, last KV events). `close` stops it after them.
        self._redis = subprocess.Popen(
            guarded([exe, str(config)]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd=self.log_dir, process_group=0)
        wait_port(port, self._redis, 10, "redis-server")
        return f"redis://:{password}@127.0.0.1:{port}/0"

    def placement(self, role: str, index: int) -> list[str]:
        """Share the machine instead of oversubscribing it. Decode workers (latency) split the
        CPUs between them; prefill workers (throughput) may use every CPU, at a lower priority,
        so a decode step preempts prefill rather than running on half the cores (a hard split
        halves decode speed on a small machine), and each prefill step runs on a thread per
        CPU the others leave free (--adapt-threads: a thread on a CPU a decode worker
        computes on would hold every parallel region up). Flags in extra_worker_args
        override these (`--threads 1`: one thread throughout)."""
        if not self.place_workers:
            return []
        cpus = sorted(os.sched_getaffinity(0))
        if role == "decode":
            n = max(self.n_decode, index + 1)  # a worker added later takes its own share
            if n >= len(cpus):
                group = [cpus[index % len(cpus)]]
            else:
                size = len(cpus) // n
                end = len(cpus) if index == n - 1 else (index + 1) * size
                group = cpus[index * size:end]
            return ["--cpus", ",".join(map(str, group))]
        threads = max(1, len(cpus) // max(1, self.n_prefill))
        return ["--threads", str(threads), "--nice", str(self.prefill_nice), "--adapt-threads"]

    def add_worker(self, role: str, index: int, wait: bool = True,
                   timeout_s: float = 180) -> str:
        name = f"{role}-{index}"
        port = self.ports[name] = free_port()
        mport = self.metrics_ports[name] = free_port()
        proc = self._spawn(name, self._pdserve(f"{role}-worker", "--worker-id", name,
                                               "--port", str(port), "--metrics-port",
                                               str(mport), *self.placement(role, index),
                                               *self._tls_args(role), *self.extra,
                                               *self.extra_by_role.get(role, ())))
        if wait:
            wait_port(port, proc, timeout_s, name, self._log(name))
        return name

    def add_router(self, index: int, timeout_s: float = 120) -> tuple[int, int]:
        """Another router (a replica: same Redis, namespace and secret, its own index from
        the same KV events) as process ``router-{index}``; returns its (gRPC, HTTP) ports."""
        grpc_port, http_port = free_port(), free_port()
        proc = self._spawn(f"router-{index}", self._pdserve(
            "router", "--port", str(grpc_port), "--http-port", str(http_port),
            *self._tls_args("router"), *self.router_args))
        wait_port(http_port, proc, timeout_s, f"router-{index}",
                  self._log(f"router-{index}"))
        return grpc_port, http_port

    def start(self, timeout_s: float = 300) -> LocalCluster:
        """Start everything; TimeoutError unless ready within `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        self.start_redis()
        for i in range(self.n_decode):
            self.add_worker("decode", i, wait=False)
        for i in range(self.n_prefill):
            self.add_worker("prefill", i, wait=False)
        router = self._spawn("router", self._pdserve(
            "router", "--port", str(self.grpc_port), "--http-port", str(self.http_port),
            *self._tls_args("router"), *self.router_args))
        wait_port(self.http_port, router, max(0.0, deadline - time.monotonic()), "router",
                  self._log("router"))
        self.wait_ready(max(0.0, deadline - time.monotonic()))
        return self

    def auth_headers(self) -> dict[str, str]:
        """The router's gateway wants a key on every route but /health when it has keys
        (--api-key / --api-keys in router_args, else PDSERVE_API_KEY(S) in the environment it
        inherits); this sends the first."""
        keys = api_keys_from_argv(self.router_args) or api_keys_from_env(self.env)
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Until every worker is registered with the router (its gateway's worker listing)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        want = self.n_decode + self.n_prefill
        headers, verify = self.auth_headers(), self.http_verify()
        while True:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise exited_error(name, p, self._log(name))
            try:
                r = httpx.get(f"{self.http_url}/v1/pdserve/workers", headers=headers,
                              timeout=2, verify=verify)
                if r.status_code == 200 and len(r.json().get("workers", [])) >= want:
                    return
                if r.status_code in (401, 403):  # waiting would not change the answer
                    raise RuntimeError(f"the gateway refused the readiness check (HTTP "
                                       f"{r.status_code}): {r.text}")
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"cluster not ready within {timeout_s:.0f}s; logs in "
                                   f"{self.log_dir}")
            time.sleep(0.3)

    def stop(self, name: str, sig: signal.Signals = signal.SIGTERM,
             timeout_s: float = 60) -> int | None:
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return None if p is None else p.returncode
        p.send_signal(sig)
        try:
            return p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait(timeout=10)

    def close(self, timeout_s: float = 90) -> None:
        """Stop the router, then every worker at once (they drain in parallel), then Redis;
        whatever has not exited within `timeout_s` is killed."""
        self.stop("router", timeout_s=timeout_s)
        workers = [p for n, p in self.procs.items() if n != "router" and p.poll() is None]
        for p in workers:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in workers:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        if self._redis is not None:
            self._redis.terminate()
            self._redis.wait(timeout=10)

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def new_cluster_secret() -> str:
    """A random cluster secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def stream_completion(url: str, prompt: str, max_tokens: int, out: Any = sys.stdout,
                      headers: Mapping[str, str] | None = None, model: str = "default",
                      temperature: float = 0.0, verify: Any = True) -> None:
    """Send one chat request to the gateway at ``url`` and stream the answer to ``out``
    (`verify`: httpx's, an `ssl.SSLContext` for a gateway on TLS)."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": True, "temperature": temperature}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers=dict(headers or {}), verify=verify) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"request failed: HTTP {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            for choice in data.get("choices", []):
                out.write(choice.get("delta", {}).get("content") or "")
                out.flush()
    out.write("\n")
