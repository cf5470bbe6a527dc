"""Router load harness: the real router process against many emulated decode workers.

    python -m bench.router_harness [--workers 64 256] [--quick] \\
        [--out docs/bench/router_harness.json]

What runs (every piece is the project's own code and wire protocol; only the model is
emulated):

- a private **redis-server** (no persistence) on a free port;
- the **router**, started with the command `pdserve cluster up` / `LocalCluster` gives it
  (``python -m pdserve.cli router --port P --http-port H --namespace NS --host 127.0.0.1
  --model M``, the cluster secret and an API key in its environment, Redis URL too), pinned
  to ONE CPU with ``taskset -c``; its log level is its default (info: one JSON line per
  routing decision, as deployed) unless --router-log-level says otherwise;
- **N emulated decode workers** in one process (`bench.emulated_workers`): each the real
  `DecodeWorker` + `decode_svc.servicer` on its own grpc.aio server and port, with its own
  signed lease and heartbeat in Redis and its own `KVEventPublisher`, over an
  `EmulatedEngine` (real scheduler and block manager, steps lasting what the measured
  profile docs/bench/cluster_sim/engine_profile.json says, x --time-scale). Their prefix
  caches start filled with a chat corpus so the router's index holds ~--index-blocks blocks;
- the **load generator** (this process): grpc.aio clients of the router's public API
  (`pdserve.v1.Router/Generate`, token ids in, return_timings set), pinned with the workers
  and Redis to the other CPU(s).

Workloads (client side; the corpus is `bench.emulated_workers.build_corpus`, the same one the
workers warmed their caches with):
- ``prefix``: multi-turn chat. 60% a new turn of a known conversation (its history, which
  includes the tokens it got back, + 50-200 new user tokens), 30% a new conversation on one
  of the 256 shared system prompts, 10% an unrelated prompt (200-2000 tokens); 8 output
  tokens; standard class.
- ``prefix1``: ``prefix`` with 1 output token (a request's fixed cost, without the per-token
  relay of the other 7).
- ``stream``: ``prefix`` with 128 output tokens (the per-token relay: against ``prefix1``,
  the router's CPU per token it streams).
- ``mixed``: 30% / 20% / 50% of the same kinds, unrelated prompts 100-4000 tokens
  (log-uniform), 1-32 output tokens, classes 20% interactive / 60% standard / 20% batch.

Phases per worker count and workload: a warm-up (not counted), then ``light`` (Poisson
arrivals at --light-rate for --light-s: latency with little queueing), ``direct`` (the same
arrivals, as long, sent by the load generator straight to the worker the request's cache is
likely on, with the router's own client code, `router.clients.DecodeClient`, and
credentials: `DirectClient`; --no-direct skips it) and
``saturate`` (--concurrency closed loops for --saturate-s: the most the whole setup serves).

Per phase: requests/s served; the router process's CPU time (/proc/PID/stat) per request,
and so the full-path requests/s the router would do with its one core 100% busy; the
router's own decision time (`route_ms` of `router.timings.StageClock`: from the start of
`Router._generate` to a placement, i.e. `Router.place` = `router.placement.place` + the
ledger, no I/O) and 1 / its mean = decisions/s of the placement code in the process, by the
wall clock: it includes the time the router's own gRPC threads, sharing its one core, take
the core while a placement runs; and the same from CPU time: `Router.place`'s thread CPU
(pdserve_router_placement_cpu_seconds_total) over the decisions it made
(pdserve_router_decisions_total) = `decisions_per_cpu_s`, what one core can place; added
latency = client-observed TTFT minus the worker's own time (from its Generate reaching the
worker to its first token leaving the engine, same CLOCK_MONOTONIC), split into the inbound
(client -> router -> worker) and outbound (worker -> router -> client) legs; what of it is
the router's (`router_added_ms`): that minus the direct phase's (`hop_overhead_ms`: the
client's hop to a worker and back, and the worker's gRPC and credential check outside its
engine, which a request pays with no router too), quantile by quantile; the prefix-hit
rate (prompt tokens the chosen worker's cache held when the request arrived) against the
oracle (the most any worker's cache held at that moment, `CacheOracle`); KV events the
router folded (its pdserve_router_kv_events_ops_total) per second. Every token of every
request is checked against the emulated engine's deterministic tokens.

Per worker count: the router's RSS before any worker and after its index holds the warm
corpus (index memory, with the index's block count from its gauge), the rate at which the
router absorbed the opening snapshots, and at the end the index checked: the router's
distinct block count equals the workers' (the oracle's), and an index built here by the real
`KVIndexFollower` from the same streams equals every worker's cache, block for block.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import platform
import random
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.emulated_engine import VOCAB, emulated_token
from bench.emulated_workers import MAX_MODEL_LEN, build_corpus
from pdserve.cluster import (
    API_KEY_ENV,
    CLUSTER_SECRET_ENV,
    REDIS_URL_ENV,
    free_port,
    wait_port,
)
from pdserve.deathsig import guarded
from pdserve.errors import PdserveError
from pdserve.rpc import core_env
from pdserve.types import GenerateRequest, LatencyClass, SamplingParams
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.clients import DecodeClient

ROOT = Path(__file__).resolve().parents[1]
TARGET_DECISIONS_PER_S = 10_000.0
TARGET_P50_MS = 0.5
TARGET_P99_MS = 2.0
TIMEOUT_S = 600.0
_LATENCY = {"interactive": common_pb2.LATENCY_CLASS_INTERACTIVE,
            "standard": common_pb2.LATENCY_CLASS_STANDARD,
            "batch": common_pb2.LATENCY_CLASS_BATCH}


@dataclass(frozen=True)
class Config:
    workers: tuple[int, ...] = (64, 256)
    index_blocks: int = 1_000_000
    time_scale: float = 0.02
    workloads: tuple[str, ...] = ("prefix", "prefix1", "mixed")
    warmup_s: float = 5.0
    idle_s: float = 5.0
    light_rate: float = 25.0
    light_s: float = 15.0
    # After each light phase, as long again at its rate straight to the workers (`DirectClient`):
    # the baseline of the router's added latency (`router_added_ms`).
    direct: bool = True
    # Then this many requests each way, one at a time, routed and direct in turn (`run_paired`):
    # the router's added latency with no queueing and no drift between the two samples.
    paired: int = 300
    concurrency: int = 48
    saturate_s: float = 25.0
    seed: int = 1
    router_log_level: str = "info"
    # The router's local requests on one Session call per worker (its default); False runs
    # it with --no-worker-sessions, a Generate call per request.
    worker_sessions: bool = True
    # The router's --data-plane: "python" (grpc.aio serves its gRPC API) or "compiled"
    # (router/_dataplane.cc relays local routes; router.dataplane).
    data_plane: str = "python"
    # The router's --placement: threshold, as every record before stop 62 measured it (cost
    # became the router's default then).
    placement: str = "threshold"
    verify_index: bool = True
    model: str = "default"
    autogroup_nice: int | None = None
    # The router's --share-inflight (None: its default); 0 runs it with no in-flight sharing.
    share_inflight_s: float | None = None
    # Idle routers started beside the measured one, on the same Redis and the other CPUs:
    # it shares its in-flight counts with them (pushes as it places, exchanges every
    # --share-inflight), which is what sharing costs a router replica.
    peer_routers: int = 0


QUICK = Config(workers=(4,), index_blocks=20_000, warmup_s=1.0, idle_s=1.0, light_rate=20.0,
               light_s=2.0, paired=20, concurrency=8, saturate_s=2.0)


# ---------------------------------------------------------------------- processes


def _cpus(cpus: set[int]) -> tuple[list[int], list[int]]:
    """(the router's CPU, everyone else's) out of `cpus`: the harness's affinity as it started,
    read once, before it pins itself to the others (read after, the router would be pinned
    to the others' core too, leaving its own idle: the records made before this was fixed,
    docs/bench/router_harness_*_{7f0752c,5718701,beffe48*}.json, ran so)."""
    ordered = sorted(cpus)
    return ordered[:1], (ordered[1:] or ordered[:1])


def _taskset(cpus: Sequence[int]) -> list[str]:
    exe = shutil.which("taskset")
    return [exe, "-c", ",".join(map(str, cpus))] if exe else []


def _ping(port: int) -> bool:
    import socket
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(workdir: Path, cpus: Sequence[int]) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed")
    for _ in range(5):
        port = free_port()
        proc = subprocess.Popen(guarded([*_taskset(cpus), exe, "--port", str(port), "--bind",
                                         "127.0.0.1", "--save", "", "--appendonly", "no"]),
                                cwd=workdir, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            if _ping(port):
                return proc, f"redis://127.0.0.1:{port}/0"
            time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=5)
    raise RuntimeError("could not start redis-server")


def _stop(proc: subprocess.Popen[Any] | None, timeout_s: float = 20) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_busy(cpu: int) -> tuple[float, float]:
    """(busy, total) jiffies of one CPU from /proc/stat."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            v = [int(x) for x in line.split()[1:]]
            idle = v[3] + v[4]
            return float(sum(v) - idle), float(sum(v))
    return 0.0, 0.0


_METRIC = re.compile(r"^(pdserve_router_[a-z_]+?)(?:_total)?(?:\{[^}]*\})? ([0-9.e+-]+)$")


_OVERHEAD_BUCKET = re.compile(
    r'^pdserve_router_overhead_seconds_bucket\{(?=[^}]*le="([^"]+)")(?=[^}]*part="(\w+)")'
    r'[^}]*\} ([0-9.e+-]+)$')


def router_metrics(http: str) -> dict[str, float]:
    """The router's own Prometheus numbers (summed over labels), and the buckets of its
    own-time histogram as ``overhead:<part>:<le>`` (`overhead_ms`)."""
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        if b := _OVERHEAD_BUCKET.match(line):
            out[f"overhead:{b.group(2)}:{b.group(1)}"] = float(b.group(3))
    return out


def overhead_ms(m0: dict[str, float], m1: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The router's own time per request between two scrapes (`router.timings.OwnTime`,
    pdserve_router_overhead_seconds), by part: p50 / p90 / p99 in ms, each interpolated
    in its 0.1 ms bucket as Prometheus's histogram_quantile does, and the count."""
    out: dict[str, dict[str, Any]] = {}
    for part in ("in", "out", "total"):
        bounds = sorted((float(k.rsplit(":", 1)[1]), v - m0.get(k, 0.0))
                        for k, v in m1.items() if k.startswith(f"overhead:{part}:"))
        if not bounds or bounds[-1][1] <= 0:
            out[part] = {"n": 0}
            continue
        n = bounds[-1][1]  # the +Inf bucket: every observation
        res: dict[str, Any] = {"n": int(n)}
        for q in (0.5, 0.9, 0.99):
            rank, lo, below = q * n, 0.0, 0.0
            for le, count in bounds:
                if count >= rank:
                    if le == math.inf:  # past the last finite bound: its bound is the answer
                        res[f"p{round(q * 100)}"] = round(lo * 1e3, 4)
                    else:
                        frac = (rank - below) / (count - below) if count > below else 1.0
                        res[f"p{round(q * 100)}"] = round((lo + (le - lo) * frac) * 1e3, 4)
                    break
                lo, below = le, count
        out[part] = res
    return out


class Cluster:
    """Redis + the router process + the emulated workers' process."""

    def __init__(self, cfg: Config, workers: int, workdir: Path, cpus: set[int]):
        self.cfg, self.n, self.workdir = cfg, workers, workdir
        self.router_cpus, self.other_cpus = _cpus(cpus)
        self.namespace = f"harness{secrets.token_hex(4)}"
        self.api_key = secrets.token_urlsafe(24)
        self.secret = secrets.token_urlsafe(32)
        self.redis: subprocess.Popen[bytes] | None = None
        self.router: subprocess.Popen[bytes] | None = None
        self.peers: list[subprocess.Popen[bytes]] = []  # --peer-routers
        self.emu: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}

    def start_router(self) -> None:
        from pdserve.engine.model_store import model_id, resolve_model

        self.model_dir = resolve_model(self.cfg.model, progress=False)
        self.model_id = model_id(self.model_dir)
        self.redis, self.redis_url = start_redis(self.workdir, self.other_cpus)
        # The emulated workers get grpc's settings as `pdserve` gives its own processes.
        self.env = dict(core_env.apply({
            **os.environ, "PYTHONUNBUFFERED": "1", REDIS_URL_ENV: self.redis_url,
            CLUSTER_SECRET_ENV: self.secret, API_KEY_ENV: self.api_key}))
        self.grpc_port, self.http_port = free_port(), free_port()
        self.router = self._router(self.grpc_port, self.http_port, self.router_cpus,
                                   f"router-{self.n}.log")
        if self.cfg.autogroup_nice is not None:
            Path(f"/proc/{self.router.pid}/autogroup").write_text(str(self.cfg.autogroup_nice))
        wait_port(self.http_port, self.router, 120, "router")
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.target = f"127.0.0.1:{self.grpc_port}"
        for i in range(self.cfg.peer_routers):
            port = free_port()
            peer = self._router(free_port(), port, self.other_cpus,
                                f"router-{self.n}-peer{i}.log")
            self.peers.append(peer)
            wait_port(port, peer, 120, "peer router")

    def _router(self, grpc_port: int, http_port: int, cpus: Sequence[int],
                log_name: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "pdserve.cli", "router", "--port", str(grpc_port),
                "--http-port", str(http_port), "--namespace", self.namespace,
                "--host", "127.0.0.1", "--model", str(self.model_dir), "--no-admission",
                "--placement", self.cfg.placement,
                "--log-level", self.cfg.router_log_level,
                *([] if self.cfg.worker_sessions else ["--no-worker-sessions"]),
                *([] if self.cfg.share_inflight_s is None
                  else ["--share-inflight", str(self.cfg.share_inflight_s)]),
                "--data-plane", self.cfg.data_plane]
        # A session of its own: with --autogroup-nice it gets the same priority as the
        # harness's processes, but its own CPU share on its core. The log is the child's: our
        # copy of its descriptor is closed once it is started.
        with open(self.workdir / log_name, "wb") as log:
            return subprocess.Popen(guarded([*_taskset(cpus), *argv]),
                                    stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env, cwd=ROOT, start_new_session=True)

    def start_workers(self) -> dict[str, Any]:
        argv = [sys.executable, "-m", "bench.emulated_workers", "--workers", str(self.n),
                "--namespace", self.namespace, "--model-id", self.model_id,
                "--index-blocks", str(self.cfg.index_blocks), "--time-scale",
                str(self.cfg.time_scale), "--seed", str(self.cfg.seed)]
        with open(self.workdir / f"workers-{self.n}.log", "wb") as log:
            self.emu = subprocess.Popen(guarded([*_taskset(self.other_cpus), *argv]),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=log, env=self.env, cwd=ROOT, text=True)
        self.info = self._reply(TIMEOUT_S)
        if not self.info.get("ready"):
            raise RuntimeError(f"emulated workers did not start: {self.info}")
        return self.info

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        import select

        assert self.emu is not None and self.emu.stdout is not None
        ready, _, _ = select.select([self.emu.stdout], [], [], timeout_s)
        if not ready:
            raise RuntimeError("emulated workers did not answer")
        line = self.emu.stdout.readline()
        if not line:
            raise RuntimeError(f"emulated workers exited ({self.emu.poll()}); see "
                               f"{self.workdir}/workers-{self.n}.log")
        return dict(json.loads(line))

    def command(self, cmd: str, timeout_s: float = 120) -> dict[str, Any]:
        assert self.emu is not None and self.emu.stdin is not None
        self.emu.stdin.write(cmd + "\n")
        self.emu.stdin.flush()
        return self._reply(timeout_s)

    def close(self) -> None:
        if self.emu is not None and self.emu.poll() is None:
            try:
                assert self.emu.stdin is not None
                self.emu.stdin.write("quit\n")
                self.emu.stdin.flush()
                self.emu.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        _stop(self.emu)
        if self.emu is not None:
            for pipe in (self.emu.stdin, self.emu.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        for proc in (self.router, *self.peers):
            _stop(proc)
        _stop(self.redis)


# ---------------------------------------------------------------------- the workloads

# Output tokens per request of the prefix-heavy workloads.
STREAMED = {"prefix": 8, "prefix1": 1, "stream": 128}

@dataclass
class Conversation:
    system: int
    history: array
    busy: bool = False
    home: int = -1  # a warm conversation: the worker (index) whose cache it started in
    worker: str = ""  # the worker that served its last turn


class Workload:
    """Prompts of one workload over the warm corpus; conversations grow with the tokens
    their requests got back."""

    def __init__(self, kind: str, corpus: Any, seed: int):
        self.kind = kind
        self.rng = random.Random(seed)
        self.systems: list[array] = corpus.systems
        self.convs = [Conversation(-1, h, home=w) for w, h in corpus.conversations]

    def _tokens(self, n: int) -> array:
        r = self.rng.randrange
        return array("i", [r(VOCAB) for _ in range(n)])

    def next(self) -> tuple[list[int], int, str, Conversation | None]:
        """(prompt, max_tokens, latency class, the conversation it continues or starts)."""
        rng = self.rng
        prefix = self.kind != "mixed"
        p_cont, p_new = (0.6, 0.3) if prefix else (0.3, 0.2)
        if prefix:
            max_tokens, klass = STREAMED[self.kind], "standard"
        else:
            max_tokens = rng.randint(1, 32)
            x = rng.random()
            klass = "interactive" if x < 0.2 else ("batch" if x > 0.8 else "standard")
        u = rng.random()
        if u < p_cont:
            for _ in range(8):
                conv = self.convs[rng.randrange(len(self.convs))]
                if not conv.busy:
                    break
            else:
                conv = None
            if conv is not None:
                prompt = conv.history + self._tokens(rng.randint(50, 200))
                if len(prompt) + max_tokens < MAX_MODEL_LEN - 512:
                    conv.busy = True
                    return prompt.tolist(), max_tokens, klass, conv
        if u < p_cont + p_new:
            s = rng.randrange(len(self.systems))
            prompt = self.systems[s] + self._tokens(rng.randint(50, 200))
            conv = Conversation(s, prompt, busy=True)
            self.convs.append(conv)
            return prompt.tolist(), max_tokens, klass, conv
        if prefix:
            n = rng.randint(200, 2000)
        else:
            n = int(math.exp(rng.uniform(math.log(100), math.log(4000))))
        return self._tokens(n).tolist(), max_tokens, klass, None


# ---------------------------------------------------------------------- the client


@dataclass
class Sample:
    label: str
    prompt_tokens: int
    t_send: float
    t_first: float = 0.0
    t_done: float = 0.0
    tokens: int = 0
    ok: bool = False
    error: str = ""
    route_ms: float | None = None
    ttft_router_ms: float | None = None
    cached_tokens: int = 0
    worker: str = ""


class _Caller:
    """One request at a time as `run_phase` sends them: a Sample with its tokens checked
    against the emulated engine's, the conversation it continues grown by them."""

    label_prefix = "h"

    def __init__(self) -> None:
        self.counter = 0
        self.bad_tokens = 0

    async def _stream(self, label: str, prompt: list[int], max_tokens: int, klass: str,
                      s: Sample, got: list[int], conv: Conversation | None) -> None:
        raise NotImplementedError

    async def one(self, prompt: list[int], max_tokens: int, klass: str,
                  conv: Conversation | None) -> Sample:
        self.counter += 1
        label = f"{self.label_prefix}{self.counter:08d}"
        s = Sample(label, len(prompt), time.monotonic())
        got: list[int] = []
        try:
            await self._stream(label, prompt, max_tokens, klass, s, got, conv)
            s.t_done = time.monotonic()
            want = [emulated_token(len(prompt), prompt[-1], i) for i in range(max_tokens)]
            s.tokens = len(got)
            s.ok = got == want and not s.error
            if got != want:
                self.bad_tokens += 1
                s.error = s.error or f"tokens differ: {len(got)} of {max_tokens}"
        except grpc.aio.AioRpcError as exc:
            s.error = f"{exc.code().name}: {exc.details()}"
        except PdserveError as exc:
            s.error = f"{exc.code}: {exc}"
        finally:
            if conv is not None:
                if s.ok:
                    conv.history = array("i", prompt) + array("i", got)
                    conv.worker = s.worker
                conv.busy = False
        return s


class Client(_Caller):
    """Through the router, as its users call it (the pdserve.v1.Router API)."""

    def __init__(self, target: str, api_key: str):
        super().__init__()
        self.channel = grpc.aio.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20)])
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.md = (("authorization", f"Bearer {api_key}"),)

    async def _stream(self, label: str, prompt: list[int], max_tokens: int, klass: str,
                      s: Sample, got: list[int], conv: Conversation | None) -> None:
        req = router_pb2.GenerateRequest(
            request_id=label, token_ids=router_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            latency_class=_LATENCY[klass], return_timings=True)
        async for resp in self.stub.Generate(req, metadata=self.md, timeout=120):
            if not s.t_first and resp.token_ids:
                s.t_first = time.monotonic()
            got.extend(resp.token_ids)
            if resp.finish_reason:
                s.cached_tokens = resp.usage.cached_tokens
                s.worker = resp.decode_worker
                if resp.HasField("timings"):
                    s.route_ms = resp.timings.route_ms
                    s.ttft_router_ms = resp.timings.first_token_ms
                if resp.error:
                    s.error = resp.error

    async def close(self) -> None:
        await self.channel.close()


class DirectClient(_Caller):
    """Straight to a decode worker, with the router's own client code
    (router.clients.DecodeClient) and credentials: what a request's two gRPC hops and the
    worker's own handling outside its engine cost with no router between, the baseline the
    router's added latency is measured against. Its worker is the one the request's cache
    is likely on, as the router would choose (so the workers do the same work as under the
    router): a conversation's last worker (or the one whose cache it started in), else the
    last worker a conversation on the same system prompt went to, else a random one."""

    label_prefix = "d"

    def __init__(self, workers: Sequence[tuple[str, str]], secret: str, seed: int):
        from pdserve.rpc.auth import ClusterSecret
        from pdserve.rpc.transport import channel

        super().__init__()
        md = ClusterSecret(secret.encode()).grpc_metadata()
        self.channels = [channel(address) for _, address in workers]
        # A Generate call per request, as any client of a worker makes (the router's API is
        # a call per request too): the router's Session calls are part of what it adds.
        self.workers = [DecodeClient(ch, worker_id=w, metadata=md, sessions=False)
                        for ch, (w, _) in zip(self.channels, workers, strict=True)]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.by_system: dict[int, DecodeClient] = {}
        self.rng = random.Random(seed)

    def _pick(self, conv: Conversation | None) -> DecodeClient:
        if conv is None:
            return self.rng.choice(self.workers)
        w = self.by_id.get(conv.worker)
        if w is None and 0 <= conv.home < len(self.workers):
            w = self.workers[conv.home]
        if w is None:
            w = self.by_system.get(conv.system)
        if w is None:
            w = self.rng.choice(self.workers)
        if conv.system >= 0:
            self.by_system[conv.system] = w
        return w

    async def _stream(self, label: str, prompt: list[int], max_tokens: int, klass: str,
                      s: Sample, got: list[int], conv: Conversation | None) -> None:
        req = GenerateRequest(label, tuple(prompt),
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              LatencyClass(klass))
        worker = self._pick(conv)
        s.worker = worker.worker_id
        async for ev in worker.generate(req, first_token_timeout_s=120, token_timeout_s=120):
            if ev.token_id is not None:
                if not s.t_first:
                    s.t_first = time.monotonic()
                got.append(ev.token_id)
            if ev.finished:
                s.cached_tokens = ev.num_cached_tokens
                s.error = ev.error or ""

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self.channels))


async def run_phase(client: _Caller, load: Workload, *, seconds: float,
                    rate: float | None = None, concurrency: int = 1,
                    max_in_flight: int = 2000) -> tuple[list[Sample], float]:
    """Open loop (Poisson at `rate`) or `concurrency` closed loops for `seconds`; returns
    the samples and the wall time until the last one ended."""
    samples: list[Sample] = []
    t0 = time.monotonic()
    end = t0 + seconds
    if rate is None:
        async def loop() -> None:
            while time.monotonic() < end:
                samples.append(await client.one(*load.next()))
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    else:
        tasks: set[asyncio.Task[Sample]] = set()
        rng = random.Random(7)
        t = t0
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            delay = t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) >= max_in_flight:
                continue
            task = asyncio.create_task(client.one(*load.next()))
            tasks.add(task)
            task.add_done_callback(lambda tk: (tasks.discard(tk), samples.append(tk.result())))
        if tasks:
            await asyncio.wait(tasks)
    return samples, time.monotonic() - t0


async def run_paired(routed: _Caller, direct: _Caller, load: Workload, n: int
                     ) -> tuple[list[Sample], list[Sample]]:
    """`n` requests through the router and `n` straight to the workers, one at a time and
    in turn: each routed request's neighbours in time are direct ones, so a drift of the
    machine (the emulator's load, the index, a collection) reaches both samples alike."""
    a: list[Sample] = []
    b: list[Sample] = []
    for _ in range(n):
        a.append(await routed.one(*load.next()))
        b.append(await direct.one(*load.next()))
    return a, b


# ---------------------------------------------------------------------- statistics


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def dist(values: Sequence[float]) -> dict[str, float | None]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {"n": len(values), "p50": r(pct(values, 0.5)), "p90": r(pct(values, 0.9)),
            "p99": r(pct(values, 0.99)), "mean": r(statistics.fmean(values)) if values else None,
            "max": r(max(values)) if values else None}


def _errors(samples: list[Sample]) -> dict[str, int]:
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            key = s.error.split(":")[0][:60]
            errors[key] = errors.get(key, 0) + 1
    return errors


def summarize_direct(samples: list[Sample], records: dict[str, list[Any]],
                     wall_s: float) -> dict[str, Any]:
    """A direct phase: client TTFT minus the worker's own time, with no router between
    (`hop_overhead_ms`): the part of `added_latency_ms` that is not the router's."""
    ok = [s for s in samples if s.ok]
    over, worker_ms, ttft = [], [], []
    for s in ok:
        ttft.append((s.t_first - s.t_send) * 1e3)
        if (rec := records.get(s.label)) is not None:
            worker_ms.append((rec[3] - rec[2]) * 1e3)
            over.append(ttft[-1] - worker_ms[-1])
    return {"requests": len(samples), "ok": len(ok), "errors": _errors(samples),
            "wall_s": round(wall_s, 2), "requests_per_s": round(len(ok) / wall_s, 1),
            "hop_overhead_ms": dist(over), "client_ttft_ms": dist(ttft),
            "worker_time_ms": dist(worker_ms), "matched_worker_records": len(over)}


def router_added(light: dict[str, Any], direct: dict[str, Any]) -> dict[str, float | None]:
    """What the router adds to TTFT: the light phase's added latency minus the direct
    phase's hop overhead, quantile by quantile (the same arrivals, the same workers and
    client code, one after the other; not paired request by request)."""
    out: dict[str, float | None] = {}
    for q in ("p50", "p90", "p99"):
        a, b = light["added_latency_ms"].get(q), direct["hop_overhead_ms"].get(q)
        out[q] = None if a is None or b is None else round(a - b, 4)
    return out


def summarize_paired(routed: list[Sample], direct: list[Sample],
                     records: dict[str, list[Any]]) -> dict[str, Any]:
    """A paired phase: the routed requests' added latency, the direct ones' hop overhead
    (each client TTFT minus its worker's own time), their difference by quantile, and that
    difference's 95 % bootstrap interval (`paired_interval`)."""
    def over(s: Sample) -> float | None:
        if not s.ok or (rec := records.get(s.label)) is None:
            return None
        return (s.t_first - s.t_send) * 1e3 - (rec[3] - rec[2]) * 1e3
    a = [over(s) for s in routed]
    b = [over(s) for s in direct]
    added = dist([x for x in a if x is not None])
    hop = dist([x for x in b if x is not None])
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    return {"requests": len(routed) + len(direct),
            "ok": sum(s.ok for s in routed) + sum(s.ok for s in direct),
            "errors": _errors(routed + direct), "added_latency_ms": added,
            "hop_overhead_ms": hop,
            "router_added_ms": {q: None if added[q] is None or hop[q] is None
                                else round(added[q] - hop[q], 4)  # type: ignore[operator]
                                for q in ("p50", "p90", "p99")},
            "router_added_ms_ci95": {q: paired_interval(pairs, x)
                                     for q, x in (("p50", 0.5), ("p99", 0.99))}}


def paired_interval(pairs: Sequence[tuple[float, float]], q: float, *,
                    resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """95 % bootstrap interval of quantile `q` of the routed values minus that of the direct
    ones: the pairs (a routed request and the direct one sent after it) are resampled with
    replacement, as pairs, so what drifted between neighbours stays paired. How far apart
    two runs' `router_added_ms` may be by chance alone; None under 20 pairs."""
    if len(pairs) < 20:
        return None
    arr = np.asarray(pairs, dtype=np.float64)
    pick = np.random.default_rng(seed).integers(0, len(arr), size=(resamples, len(arr)))
    diff = np.quantile(arr[pick, 0], q, axis=1) - np.quantile(arr[pick, 1], q, axis=1)
    lo, hi = np.quantile(diff, (0.025, 0.975))
    return [round(float(lo), 4), round(float(hi), 4)]


def summarize(samples: list[Sample], records: dict[str, list[Any]], wall_s: float,
              router_cpu_s: float, router_core_busy: float,
              metrics0: dict[str, float], metrics1: dict[str, float]) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    errors = _errors(samples)
    added, inbound, outbound, worker_ms, ttft, router_side = [], [], [], [], [], []
    prompt = cached = oracle = 0
    for s in ok:
        ttft.append((s.t_first - s.t_send) * 1e3)
        rec = records.get(s.label)
        if rec is None:
            continue
        # rec: request_id, worker, t_recv, t_first, prompt, cached, oracle, out, t_done
        w_ms = (rec[3] - rec[2]) * 1e3
        worker_ms.append(w_ms)
        added.append((s.t_first - s.t_send) * 1e3 - w_ms)
        inbound.append((rec[2] - s.t_send) * 1e3)
        if s.ttft_router_ms is not None:
            router_side.append(s.ttft_router_ms - w_ms)
        outbound.append((s.t_first - rec[3]) * 1e3)
        prompt += rec[4]
        cached += rec[5]
        oracle += rec[6]
    route = [s.route_ms for s in ok if s.route_ms is not None]
    n = len(ok)
    streamed = sum(s.tokens for s in ok)
    d_ops = metrics1.get("pdserve_router_kv_events_ops", 0) - \
        metrics0.get("pdserve_router_kv_events_ops", 0)
    d_dec = metrics1.get("pdserve_router_decisions", 0) - \
        metrics0.get("pdserve_router_decisions", 0)
    d_cpu = metrics1.get("pdserve_router_placement_cpu_seconds", 0) - \
        metrics0.get("pdserve_router_placement_cpu_seconds", 0)
    route_mean = statistics.fmean(route) if route else None
    return {
        "requests": len(samples), "ok": n, "errors": errors,
        "wall_s": round(wall_s, 2), "requests_per_s": round(n / wall_s, 1),
        "router_decisions_counted": d_dec,
        "router_cpu_s": round(router_cpu_s, 3),
        "router_cpu_utilization": round(router_cpu_s / wall_s, 3),
        "router_core_busy": round(router_core_busy, 3),
        "router_cpu_ms_per_request": round(router_cpu_s / n * 1e3, 4) if n else None,
        "tokens_per_s": round(streamed / wall_s, 1),
        "router_cpu_us_per_token": round(router_cpu_s / streamed * 1e6, 2) if streamed else None,
        "full_path_requests_per_router_core_s": round(n / router_cpu_s, 1)
        if router_cpu_s else None,
        "route_ms": dist(route),
        "router_overhead_ms": overhead_ms(metrics0, metrics1),
        "decisions_per_s_from_route_ms": round(1e3 / route_mean, 1) if route_mean else None,
        "placement_cpu_us_per_decision": round(d_cpu / d_dec * 1e6, 2) if d_dec else None,
        "decisions_per_cpu_s": round(d_dec / d_cpu, 1) if d_cpu > 0 else None,
        # the other routers whose in-flight counts it took in, at the phase's end
        "peer_routers": metrics1.get("pdserve_router_peer_routers"),
        "added_latency_ms": dist(added), "inbound_ms": dist(inbound),
        "outbound_ms": dist(outbound), "worker_time_ms": dist(worker_ms),
        "router_side_added_ms": dist(router_side),
        "client_ttft_ms": dist(ttft),
        "matched_worker_records": len(added),
        "prefix_hit_rate": round(cached / prompt, 4) if prompt else None,
        "oracle_hit_rate": round(oracle / prompt, 4) if prompt else None,
        "hit_rate_vs_oracle": round(cached / oracle, 4) if oracle else None,
        "kv_ops_absorbed_per_s": round(d_ops / wall_s, 1),
    }


# ---------------------------------------------------------------------- one worker count


async def _wait_index(cluster: Cluster, want: int, timeout_s: float
                      ) -> tuple[float, dict[str, float], list[tuple[float, float]]]:
    t0 = time.monotonic()
    trace = []
    while True:
        m = await asyncio.to_thread(router_metrics, cluster.http)
        blocks = m.get("pdserve_router_kv_index_blocks", 0)
        trace.append((round(time.monotonic() - t0, 2), blocks))
        if blocks >= want:
            return time.monotonic() - t0, m, trace
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"router index holds {blocks} blocks after {timeout_s}s, "
                               f"want {want}")
        await asyncio.sleep(0.25)


async def verify_index(cluster: Cluster, workdir: Path) -> dict[str, Any]:
    """The router's distinct-block gauge against the workers, and an index built here by
    the real follower from the same streams against every worker's cache."""
    from pdserve.control.kv_events import KVEventStreams
    from pdserve.control.registry import WorkerRegistry
    from pdserve.control.signing import signer_for
    from pdserve.errors import ControlPlaneError
    from pdserve.rpc.auth import ClusterSecret
    from router.kv_follow import KVIndexFollower
    from router.kv_index import KVIndex

    path = workdir / f"digest-{cluster.n}.json"
    await asyncio.sleep(1.0)  # publishers batch every 20 ms; the router polls
    await asyncio.to_thread(cluster.command, f"digest {path}")
    digest: dict[str, list[str]] = json.loads(path.read_text())
    distinct = len({h for hs in digest.values() for h in hs})
    deadline = time.monotonic() + 30
    while True:
        m = await asyncio.to_thread(router_metrics, cluster.http)
        router_blocks = int(m.get("pdserve_router_kv_index_blocks", -1))
        if router_blocks == distinct or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    index = KVIndex()
    secret = ClusterSecret(cluster.secret.encode())
    # Its first reads take every stream from the start: at 256 workers on a slow machine one
    # such XREAD takes longer than a router's 2 s bound, read after read.
    async with WorkerRegistry.from_url(cluster.redis_url, namespace=cluster.namespace,
                                       signer=signer_for(secret, cluster.namespace),
                                       op_timeout_s=30.0) as reg:
        follower = KVIndexFollower(KVEventStreams(reg), index, lambda: list(digest))
        deadline = time.monotonic() + 60
        while True:
            try:
                await follower.poll()
            except ControlPlaneError:  # a long read of every stream from its start, on a
                if time.monotonic() > deadline:  # busy machine: read again
                    raise
                continue
            same = all(index.synced(w) and {h.hex() for h in index.held(w)} == set(hs)
                       for w, hs in digest.items())
            if same or time.monotonic() > deadline:
                break
    mismatched = [w for w, hs in digest.items()
                  if {h.hex() for h in index.held(w)} != set(hs)]
    return {"workers_distinct_blocks": distinct, "router_index_blocks": router_blocks,
            "router_equals_workers": router_blocks == distinct,
            "follower_index_equals_caches": not mismatched,
            "mismatched_workers": mismatched[:8]}


async def _records(cluster: Cluster, workdir: Path, name: str
                   ) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """The workers' request records since the last dump, by the client's label, and the
    emulator's reply to the dump."""
    path = workdir / f"records-{name}.json"
    reply = await asyncio.to_thread(cluster.command, f"dump {path}")
    return {r[0].rpartition(":")[2]: r for r in json.loads(path.read_text())}, reply


async def run_workers(cfg: Config, n: int, workdir: Path, cpus: set[int]) -> dict[str, Any]:
    cluster = Cluster(cfg, n, workdir, cpus)
    out: dict[str, Any] = {"workers": n}
    try:
        cluster.start_router()
        await asyncio.sleep(2.0)  # let it settle (imports done, directory polling)
        assert cluster.router is not None
        pid = cluster.router.pid
        out["router_rss_idle_bytes"] = proc_rss(pid)
        t_start = time.monotonic()
        info = await asyncio.to_thread(cluster.start_workers)
        out["workers_start_s"] = round(time.monotonic() - t_start, 1)
        out["workers_cached_blocks"] = info["cached_blocks"]
        out["workers_distinct_blocks"] = info["distinct_blocks"]
        out["blocks_per_worker_pool"] = info["blocks_per_worker"]
        cpu0 = proc_cpu_s(pid)
        sync_s, m, trace = await _wait_index(cluster, info["distinct_blocks"], TIMEOUT_S)
        ops = m.get("pdserve_router_kv_events_ops", 0)
        # The snapshots were published while the workers started; the router read them as
        # they came and then the rest: its rate is ops over the time from the first worker's
        # registration (about when the workers' process said ready minus its start) to full.
        out["index_sync"] = {
            "after_workers_ready_s": round(sync_s, 2),
            "ops_folded": ops, "router_cpu_s": round(proc_cpu_s(pid) - cpu0, 2),
            "trace": trace[-20:]}
        out["router_rss_loaded_bytes"] = proc_rss(pid)
        out["index_blocks"] = m.get("pdserve_router_kv_index_blocks", 0)
        out["router_rss_per_block_bytes"] = round(
            (out["router_rss_loaded_bytes"] - out["router_rss_idle_bytes"])
            / max(out["index_blocks"], 1), 1)
        corpus = await asyncio.to_thread(build_corpus, cfg.seed, n, cfg.index_blocks)
        gc.collect()
        gc.freeze()  # the corpus is long-lived: keep the cyclic GC off it
        # The router's own background work (directory polls, heartbeats read, the KV follower's
        # XREADs, liveness), with no request: subtracted to get a request's net CPU cost.
        await asyncio.sleep(2.0)
        c0, t0 = proc_cpu_s(pid), time.monotonic()
        await asyncio.sleep(cfg.idle_s)
        idle_rate = (proc_cpu_s(pid) - c0) / (time.monotonic() - t0)
        out["router_idle_cpu_utilization"] = round(idle_rate, 4)
        client = Client(cluster.target, cluster.api_key)
        direct = DirectClient(list(zip(cluster.info["workers"], cluster.info["addresses"],
                                       strict=True)), cluster.secret, cfg.seed)
        rcpu = cluster.router_cpus[0]
        assert cluster.emu is not None
        emu_pid = cluster.emu.pid
        out["affinity"] = {"router": sorted(os.sched_getaffinity(pid)),
                           "workers": sorted(os.sched_getaffinity(emu_pid)),
                           "load_generator": sorted(os.sched_getaffinity(0))}
        out["phases"] = {}
        try:
            for wi, kind in enumerate(cfg.workloads):
                load = Workload(kind, corpus, cfg.seed * 1000 + wi)
                await run_phase(client, load, seconds=cfg.warmup_s,
                                concurrency=max(1, cfg.concurrency // 2))
                await asyncio.to_thread(cluster.command, f"dump {workdir}/discard.json")
                light_kw = {"rate": cfg.light_rate, "seconds": cfg.light_s}
                phases = [("light", light_kw), ("direct", light_kw),
                          ("saturate", {"concurrency": cfg.concurrency,
                                        "seconds": cfg.saturate_s})]
                for phase, kw in phases if cfg.direct else phases[::2]:
                    if phase == "direct":
                        samples, wall = await run_phase(direct, load, **kw)  # type: ignore[arg-type]
                        records, _ = await _records(cluster, workdir, f"{n}-{kind}-direct")
                        res = summarize_direct(samples, records, wall)
                        light = out["phases"][f"{kind}/light"]
                        light["router_added_ms"] = router_added(light, res)
                        out["phases"][f"{kind}/direct"] = res
                        print(json.dumps({"workers": n, "phase": f"{kind}/direct",
                                          "ok": res["ok"], "errors": res["errors"],
                                          "hop_overhead_ms": res["hop_overhead_ms"],
                                          "router_added_ms": light["router_added_ms"]}),
                              flush=True)
                        if cfg.paired:
                            m0 = await asyncio.to_thread(router_metrics, cluster.http)
                            routed_s, direct_s = await run_paired(client, direct, load,
                                                                  cfg.paired)
                            m1 = await asyncio.to_thread(router_metrics, cluster.http)
                            records, _ = await _records(cluster, workdir,
                                                        f"{n}-{kind}-paired")
                            res = summarize_paired(routed_s, direct_s, records)
                            res["router_overhead_ms"] = overhead_ms(m0, m1)
                            out["phases"][f"{kind}/paired"] = res
                            print(json.dumps({"workers": n, "phase": f"{kind}/paired",
                                              **{k: res[k] for k in (
                                                  "ok", "errors", "added_latency_ms",
                                                  "hop_overhead_ms", "router_added_ms",
                                                  "router_overhead_ms")}}),
                                  flush=True)
                        continue
                    m0 = await asyncio.to_thread(router_metrics, cluster.http)
                    c0, b0 = proc_cpu_s(pid), cpu_busy(rcpu)
                    e0, h0 = proc_cpu_s(emu_pid), proc_cpu_s(os.getpid())
                    samples, wall = await run_phase(client, load, **kw)  # type: ignore[arg-type]
                    c1, b1 = proc_cpu_s(pid), cpu_busy(rcpu)
                    e1, h1 = proc_cpu_s(emu_pid), proc_cpu_s(os.getpid())
                    m1 = await asyncio.to_thread(router_metrics, cluster.http)
                    records, dumped = await _records(cluster, workdir, f"{n}-{kind}-{phase}")
                    busy = (b1[0] - b0[0]) / max(b1[1] - b0[1], 1.0)
                    res = summarize(samples, records, wall, c1 - c0, busy, m0, m1)
                    net = (c1 - c0) - idle_rate * wall
                    res["router_cpu_ms_per_request_net"] = (
                        round(net / res["ok"] * 1e3, 4) if res["ok"] else None)
                    res["full_path_requests_per_router_core_s_net"] = (
                        round(res["ok"] / net, 1) if net > 0 else None)
                    res["others_on_router_core"] = round(
                        max(0.0, busy - (c1 - c0) / wall), 3)
                    res["loadavg"] = os.getloadavg()[0]
                    res["workers_process_cpu_utilization"] = round((e1 - e0) / wall, 3)
                    res["client_process_cpu_utilization"] = round((h1 - h0) / wall, 3)
                    res["workers_process"] = dumped
                    res["load"] = kw
                    out["phases"][f"{kind}/{phase}"] = res
                    print(json.dumps({"workers": n, "phase": f"{kind}/{phase}",
                                      **{k: res[k] for k in (
                                          "ok", "requests_per_s", "router_cpu_utilization",
                                          "full_path_requests_per_router_core_s",
                                          "full_path_requests_per_router_core_s_net",
                                          "others_on_router_core",
                                          "workers_process_cpu_utilization",
                                          "client_process_cpu_utilization",
                                          "decisions_per_s_from_route_ms",
                                          "decisions_per_cpu_s",
                                          "prefix_hit_rate", "oracle_hit_rate",
                                          "kv_ops_absorbed_per_s")},
                                      "route_ms": res["route_ms"],
                                      "added_ms": res["added_latency_ms"],
                                      "own_ms": res["router_overhead_ms"]["total"],
                                      "errors": res["errors"]}), flush=True)
        finally:
            await client.close()
            await direct.close()
        out["bad_token_requests"] = client.bad_tokens + direct.bad_tokens
        if cfg.verify_index:
            out["index_check"] = await verify_index(cluster, workdir)
        out["router_rss_end_bytes"] = proc_rss(pid)
    finally:
        cluster.close()
    return out


def _machine() -> dict[str, Any]:
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cpus": os.cpu_count(), "python": platform.python_version(),
            "grpc": grpc.__version__}


async def run(cfg: Config, workdir: Path) -> dict[str, Any]:
    cpus = os.sched_getaffinity(0)
    _, others = _cpus(cpus)
    os.sched_setaffinity(0, set(others))  # the load generator stays off the router's core
    results = []
    for n in cfg.workers:
        results.append(await run_workers(cfg, n, workdir, cpus))
    return {"config": asdict(cfg), "results": results}


def _meets(q: dict[str, Any]) -> bool:
    """p50 and p99 (ms) within the latency targets; a missing one does not."""
    return ((q.get("p50") or 9) <= TARGET_P50_MS) and ((q.get("p99") or 9) <= TARGET_P99_MS)


def verdicts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target against the figure that answers it, per worker count and workload."""
    out = []
    for r in record["results"]:
        for name, ph in r["phases"].items():
            if not name.endswith("/saturate"):
                continue
            light = r["phases"].get(name.replace("saturate", "light"), {})
            full = ph.get("full_path_requests_per_router_core_s_net") or 0
            dec = ph.get("decisions_per_s_from_route_ms") or 0
            dec_cpu = ph.get("decisions_per_cpu_s") or 0
            added = light.get("added_latency_ms", {})
            mine = light.get("router_added_ms", {})  # over the direct baseline
            paired_phase = r["phases"].get(name.replace("saturate", "paired"), {})
            paired = paired_phase.get("router_added_ms", {})  # one at a time, in turn
            paired_ci = paired_phase.get("router_added_ms_ci95", {})
            own_light = light.get("router_overhead_ms", {}).get("total", {})
            own_paired = paired_phase.get("router_overhead_ms", {}).get("total", {})
            out.append({
                "workers": r["workers"], "workload": name.split("/")[0],
                "decision_only_per_s": dec,
                "decision_only_meets_10k": dec >= TARGET_DECISIONS_PER_S,
                "decision_cpu_per_s": dec_cpu,
                "decision_cpu_meets_10k": dec_cpu >= TARGET_DECISIONS_PER_S,
                "full_path_per_router_core_s": full,
                "full_path_meets_10k": full >= TARGET_DECISIONS_PER_S,
                "route_ms_p50": ph["route_ms"]["p50"], "route_ms_p99": ph["route_ms"]["p99"],
                "route_ms_meets_latency": _meets(ph["route_ms"]),
                "added_ms_p50_light": added.get("p50"), "added_ms_p99_light": added.get("p99"),
                "added_meets_latency": _meets(added),
                "router_added_ms_p50_light": mine.get("p50"),
                "router_added_ms_p99_light": mine.get("p99"),
                "router_added_meets_latency": _meets(mine),
                "router_added_ms_p50_paired": paired.get("p50"),
                "router_added_ms_p99_paired": paired.get("p99"),
                "router_added_ms_p50_paired_ci95": paired_ci.get("p50"),
                "router_added_ms_p99_paired_ci95": paired_ci.get("p99"),
                "router_added_paired_meets_latency": _meets(paired),
                # Measured inside the router, per request (pdserve_router_overhead_seconds):
                # no worker's or client's time in it, so its p99 is the router's own tail.
                "router_own_ms_p50_light": own_light.get("p50"),
                "router_own_ms_p99_light": own_light.get("p99"),
                "router_own_ms_p50_paired": own_paired.get("p50"),
                "router_own_ms_p99_paired": own_paired.get("p99"),
                "router_own_paired_meets_latency": _meets(own_paired),
            })
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=None)
    p.add_argument("--quick", action="store_true", help="4 workers, a few seconds")
    p.add_argument("--index-blocks", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=None)
    p.add_argument("--workloads", nargs="+", choices=("prefix", "prefix1", "stream", "mixed"),
                   default=None)
    p.add_argument("--light-rate", type=float, default=None)
    p.add_argument("--light-s", type=float, default=None)
    p.add_argument("--saturate-s", type=float, default=None)
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--router-log-level", default=None)
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--no-direct", action="store_true",
                   help="skip the direct phase (the router's added-latency baseline)")
    p.add_argument("--paired", type=int, default=None,
                   help="requests each way in the paired phase (0: none; needs the direct "
                   "phase)")
    p.add_argument("--placement", choices=("threshold", "cost"), default=None,
                   help="the router's --placement (default threshold, as the records were "
                   "made; the router's own default is cost)")
    p.add_argument("--no-worker-sessions", action="store_true",
                   help="run the router with --no-worker-sessions (a Generate call per "
                   "request to a decode worker)")
    p.add_argument("--data-plane", choices=("python", "compiled"), default=None,
                   help="the router's --data-plane (default python)")
    p.add_argument("--share-inflight", type=float, default=None, dest="share_inflight_s",
                   help="the router's --share-inflight (default: the router's; 0: off)")
    p.add_argument("--peer-routers", type=int, default=None,
                   help="idle routers beside the measured one, on its Redis (default 0)")
    p.add_argument("--autogroup-nice", type=int, default=None,
                   help="on a machine other sessions share (Linux autogroups: each session "
                   "gets an equal CPU share whatever its processes' nice), set this "
                   "session's autogroup nice (e.g. -10; root; run under setsid so only the "
                   "harness's processes are affected)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep", type=Path, default=None, help="keep logs and records here")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    over = {k: getattr(args, k) for k in ("index_blocks", "time_scale", "light_rate",
                                          "light_s", "saturate_s", "concurrency", "paired",
                                          "router_log_level", "placement", "data_plane",
                                          "share_inflight_s", "peer_routers")
            if getattr(args, k) is not None}
    if args.workers:
        over["workers"] = tuple(args.workers)
    if args.workloads:
        over["workloads"] = tuple(args.workloads)
    if args.no_verify:
        over["verify_index"] = False
    if args.no_direct:
        over["direct"] = False
    if args.no_worker_sessions:
        over["worker_sessions"] = False
    if args.autogroup_nice is not None:
        Path("/proc/self/autogroup").write_text(str(args.autogroup_nice))
        over["autogroup_nice"] = args.autogroup_nice
    cfg = replace(cfg, **over)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="router-harness-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    record = asyncio.run(run(cfg, workdir))
    record["verdicts"] = verdicts(record)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    autogroup = Path("/proc/self/autogroup")
    record.update({"command": "python -m bench.router_harness " + " ".join(argv or sys.argv[1:]),
                   "autogroup": autogroup.read_text().strip() if autogroup.exists() else None,
                   "commit": commit, "date": datetime.now(UTC).isoformat(timespec="seconds"),
                   "machine": _machine(), "elapsed_s": round(time.monotonic() - t0, 1),
                   "workdir": str(workdir)})
    text = json.dumps(record, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps(record["verdicts"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
