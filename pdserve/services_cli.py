"""CLI subcommands for the services: workers, router, a local cluster, and a client."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("PDSERVE_REDIS_URL", DEFAULT_REDIS))
    p.add_argument("--namespace", default=os.environ.get("PDSERVE_NAMESPACE", "default"))
    p.add_argument("--host", default="127.0.0.1", help="address to bind (internal ports)")
    p.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))


def _advertise_host(args: argparse.Namespace) -> str:
    """The host other processes use to reach this worker: --advertise-host, else --host,
    else (a wildcard bind, e.g. in a container) this machine's address."""
    if args.advertise_host:
        return str(args.advertise_host)
    if args.host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return str(args.host)


def _worker_id(prefix: str) -> str:
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}"


def _run_until_signal(main: Callable[[asyncio.Event], Any], log_level: str) -> int:
    from pdserve.runtime import configure_logging, stop_event_on_signals

    configure_logging(log_level)

    async def runner() -> None:
        try:
            await main(stop_event_on_signals())
        finally:
            # With UCXPY_ENABLE_PYTHON_FUTURE (see pdserve.cli) ucxx runs a notifier thread
            # that interpreter exit would wait on forever: stop it while the loop still runs.
            ucxx = sys.modules.get("ucxx")
            if ucxx is not None:
                ucxx.stop_notifier_thread()

    asyncio.run(runner())
    return 0


def parse_cpus(spec: str) -> set[int]:
    """"0-3,6" -> {0, 1, 2, 3, 6} (the taskset/cpuset list syntax)."""
    cpus: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad CPU list {spec!r}: {exc}") from exc
    if not cpus:
        raise argparse.ArgumentTypeError(f"empty CPU list {spec!r}")
    return cpus


def _place_process(args: argparse.Namespace) -> None:
    """Apply --cpus and --nice before the engine starts its threads."""
    if args.cpus is not None:
        os.sched_setaffinity(0, args.cpus)
    if args.nice:
        os.nice(args.nice)


def _cmd_decode(args: argparse.Namespace, engine_cfg: Callable[..., Any]) -> int:
    from decode_svc.main import DecodeConfig, run_decode

    _place_process(args)
    cfg = DecodeConfig(worker_id=args.worker_id or _worker_id("decode"), redis_url=args.redis_url,
                       model=args.model, engine=engine_cfg(args), host=args.host, port=args.port,
                       advertise_host=_advertise_host(args), metrics_port=args.metrics_port,
                       ucx_host=_advertise_host(args), namespace=args.namespace)
    return _run_until_signal(lambda stop: run_decode(cfg, stop), args.log_level)


def _cmd_prefill(args: argparse.Namespace, engine_cfg: Callable[..., Any]) -> int:
    from prefill_svc.main import PrefillConfig, run_prefill

    _place_process(args)
    cfg = PrefillConfig(worker_id=args.worker_id or _worker_id("prefill"),
                        redis_url=args.redis_url, model=args.model, engine=engine_cfg(args),
                        host=args.host, port=args.port, advertise_host=_advertise_host(args),
                        metrics_port=args.metrics_port, namespace=args.namespace)
    return _run_until_signal(lambda stop: run_prefill(cfg, stop), args.log_level)


def _api_keys(flag: str | None, env: Mapping[str, str]) -> list[str]:
    """The router's API keys: the comma-separated --api-keys value, else PDSERVE_API_KEYS."""
    return [k.strip() for k in (flag or env.get("PDSERVE_API_KEYS", "")).split(",") if k.strip()]


def _cmd_router(args: argparse.Namespace) -> int:
    from router.main import RouterProcessConfig, run_router
    from router.policy import RouterPolicy
    from router.router import RouterConfig

    cfg = RouterProcessConfig(
        redis_url=args.redis_url, model=args.model, namespace=args.namespace, host=args.host,
        grpc_port=args.port, http_port=args.http_port,
        api_keys=frozenset(_api_keys(args.api_keys, os.environ)),
        max_request_bytes=args.max_request_bytes,
        router=RouterConfig(policy=RouterPolicy(
            remote_min_uncached_tokens=args.remote_threshold,
            max_prefill_backlog_tokens=args.max_prefill_backlog)))
    return _run_until_signal(lambda stop: run_router(cfg, stop), args.log_level)


# --------------------------------------------------------------------------- local cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not open port {port} within {timeout_s:.0f}s")


class LocalCluster:
    """Redis (private unless a URL is given), router, N prefill and M decode workers, as
    child processes on 127.0.0.1. Use as a context manager; stops everything on exit."""

    def __init__(self, *, prefill: int = 1, decode: int = 1, redis_url: str | None = None,
                 model: str | None = None, http_port: int = 0, grpc_port: int = 0,
                 extra_worker_args: tuple[str, ...] = (), router_args: tuple[str, ...] = (),
                 log_dir: Path | None = None,
                 namespace: str | None = None, env: dict[str, str] | None = None,
                 place_workers: bool = True, prefill_nice: int = 5):
        self.n_prefill, self.n_decode = prefill, decode
        self.place_workers, self.prefill_nice = place_workers, prefill_nice
        self.redis_url = redis_url
        self.model = model
        self.http_port = http_port or _free_port()
        self.grpc_port = grpc_port or _free_port()
        self.extra = extra_worker_args
        self.router_args = router_args
        self.ports: dict[str, int] = {}  # worker name -> gRPC port
        self.metrics_ports: dict[str, int] = {}  # worker name -> Prometheus HTTP port
        self.namespace = namespace or f"cluster{uuid.uuid4().hex[:8]}"
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pdserve-cluster-"))
        self.env = {**os.environ, **(env or {})}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._redis: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def metrics_url(self, name: str) -> str:
        """Prometheus endpoint of a worker (the router's is ``{http_url}/metrics``)."""
        return f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs[name] = proc
        return proc

    def _pdserve(self, *args: str) -> list[str]:
        base = [sys.executable, "-m", "pdserve.cli", *args, "--redis-url", str(self.redis_url),
                "--namespace", self.namespace]
        return base + (["--model", self.model] if self.model else [])

    def start_redis(self) -> None:
        if self.redis_url:
            return
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found; install it or pass --redis-url")
        port = _free_port()
        self._redis = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.log_dir)
        _wait_port(port, self._redis, 10, "redis-server")
        self.redis_url = f"redis://127.0.0.1:{port}/0"

    def _placement(self, role: str, index: int) -> list[str]:
        """Share the machine instead of oversubscribing it. Decode workers (latency) split the
        CPUs between them; prefill workers (throughput) may use every CPU, at a lower priority,
        so a decode step preempts prefill rather than running on half the cores (a hard split
        halves decode speed on a small machine). Flags in extra_worker_args override these."""
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
        return ["--threads", str(threads), "--nice", str(self.prefill_nice)]

    def add_worker(self, role: str, index: int, wait: bool = True,
                   timeout_s: float = 180) -> str:
        name = f"{role}-{index}"
        port = self.ports[name] = _free_port()
        mport = self.metrics_ports[name] = _free_port()
        proc = self._spawn(name, self._pdserve(f"{role}-worker", "--worker-id", name,
                                               "--port", str(port), "--metrics-port",
                                               str(mport), *self._placement(role, index),
                                               *self.extra))
        if wait:
            _wait_port(port, proc, timeout_s, name)
        return name

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
            *self.router_args))
        _wait_port(self.http_port, router, max(0.0, deadline - time.monotonic()), "router")
        self.wait_ready(max(0.0, deadline - time.monotonic()))
        return self

    def auth_headers(self) -> dict[str, str]:
        """The router's gateway wants a key on every route but /health when it has keys
        (--api-keys in router_args, else PDSERVE_API_KEYS in the environment it inherits)."""
        args, flag = list(self.router_args), None
        for i, arg in enumerate(args):  # the last one wins, as with argparse
            if arg == "--api-keys" and i + 1 < len(args):
                flag = args[i + 1]
            elif arg.startswith("--api-keys="):
                flag = arg.partition("=")[2]
        keys = _api_keys(flag, self.env)
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Until every worker is registered with the router (its gateway's worker listing)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        want = self.n_decode + self.n_prefill
        headers = self.auth_headers()
        while True:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {p.returncode}; see "
                                       f"{self.log_dir / (name + '.log')}")
            try:
                r = httpx.get(f"{self.http_url}/v1/pdserve/workers", headers=headers, timeout=2)
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

    def close(self) -> None:
        for name in [n for n in self.procs if n == "router"] + \
                [n for n in self.procs if n != "router"]:
            self.stop(name)
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


def _stream_completion(url: str, prompt: str, max_tokens: int, out: Any = sys.stdout,
                       headers: Mapping[str, str] | None = None) -> None:
    """Send one chat request to the gateway and stream the answer to ``out``."""
    import json

    import httpx

    body = {"model": "default", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers=dict(headers or {})) as r:
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


def _cmd_cluster(args: argparse.Namespace) -> int:
    cluster = LocalCluster(prefill=args.prefill, decode=args.decode, redis_url=args.redis_url,
                           model=args.model, http_port=args.http_port, grpc_port=args.port,
                           extra_worker_args=("--dtype", args.dtype),
                           prefill_nice=args.prefill_nice)
    print(f"starting cluster: {args.prefill} prefill, {args.decode} decode workers "
          f"(logs in {cluster.log_dir})", file=sys.stderr)
    try:
        cluster.start(args.ready_timeout)
        print(f"ready: HTTP {cluster.http_url}  gRPC {cluster.grpc_address}  "
              f"redis {cluster.redis_url}", file=sys.stderr)
        if args.demo:
            print(f"> {args.demo}", file=sys.stderr)
            _stream_completion(cluster.http_url, args.demo, args.max_tokens,
                               headers=cluster.auth_headers())
            return 0
        stop = False

        def on_signal(*_: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while not stop:
            time.sleep(0.5)
    finally:
        cluster.close()
    return 0


def _cmd_ask(args: argparse.Namespace) -> int:
    keys = [args.api_key] if args.api_key else _api_keys(None, os.environ)
    _stream_completion(args.url, args.prompt, args.max_tokens,
                       headers={"Authorization": f"Bearer {keys[0]}"} if keys else None)
    return 0


def register(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    from pdserve.cli import engine_config_from_args

    for role, fn in (("decode", _cmd_decode), ("prefill", _cmd_prefill)):
        p = sub.add_parser(f"{role}-worker", help=f"run a {role} worker")
        _common(p)
        add_engine_args(p)
        p.add_argument("--worker-id", default=None)
        p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
        p.add_argument("--metrics-port", type=int, default=0,
                       help="Prometheus /metrics HTTP port (0: any free port, -1: off)")
        p.add_argument("--cpus", type=parse_cpus, default=None,
                       help="run on these CPUs only, e.g. 0-3 (default: all allowed)")
        p.add_argument("--nice", type=int, default=0,
                       help="raise the process's nice value by this much (lower CPU priority)")
        p.add_argument("--advertise-host", default=os.environ.get("PDSERVE_ADVERTISE_HOST"),
                       help="host the router and other workers use to reach this worker "
                       "(default: --host, or this machine's address when --host is 0.0.0.0)")
        p.set_defaults(func=lambda a, fn=fn: fn(a, engine_config_from_args))

    r = sub.add_parser("router", help="run the router (gRPC) and the OpenAI HTTP gateway")
    _common(r)
    r.add_argument("--model", default=os.environ.get("PDSERVE_MODEL"))
    r.add_argument("--port", type=int, default=50051, help="gRPC port")
    r.add_argument("--http-port", type=int, default=8000, help="HTTP gateway port")
    r.add_argument("--api-keys", default=None, help="comma-separated API keys (or "
                   "PDSERVE_API_KEYS); none: no auth")
    r.add_argument("--remote-threshold", type=int, default=256,
                   help="uncached prompt tokens from which prefill goes to the prefill pool")
    r.add_argument("--max-prefill-backlog", type=int, default=16384,
                   help="prefill pool backlog (queued tokens) above which prefill stays local")
    r.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest HTTP request body (else 413) and gRPC request message (else "
                   "RESOURCE_EXHAUSTED)")
    r.set_defaults(func=_cmd_router)

    c = sub.add_parser("cluster", help="local cluster on 127.0.0.1")
    csub = c.add_subparsers(dest="cluster_command", required=True)
    up = csub.add_parser("up", help="start Redis, the router and the workers")
    up.add_argument("--prefill", type=int, default=1)
    up.add_argument("--decode", type=int, default=1)
    up.add_argument("--redis-url", default=None, help="use this Redis (default: a private one)")
    up.add_argument("--model", default=os.environ.get("PDSERVE_MODEL"))
    up.add_argument("--http-port", type=int, default=8000)
    up.add_argument("--port", type=int, default=50051, help="router gRPC port")
    up.add_argument("--demo", default=None, help="send this prompt, print the answer, stop")
    up.add_argument("--max-tokens", type=int, default=64)
    up.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16",
                                                           "int8"),
                    help="weight format of every worker (see `pdserve generate --help`)")
    up.add_argument("--prefill-nice", type=int, default=5,
                    help="nice value of prefill workers, which share every CPU with the decode "
                    "workers at a lower priority")
    up.add_argument("--ready-timeout", type=float, default=300.0,
                    help="seconds to wait for every process to be ready before giving up")
    up.set_defaults(func=_cmd_cluster)

    a = sub.add_parser("ask", help="send a chat prompt to a running gateway and stream it")
    a.add_argument("prompt")
    a.add_argument("--url", default="http://127.0.0.1:8000")
    a.add_argument("--max-tokens", type=int, default=128)
    a.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="bearer key for a keyed gateway (default: PDSERVE_API_KEY, else the "
                   "first of PDSERVE_API_KEYS)")
    a.set_defaults(func=_cmd_ask)
