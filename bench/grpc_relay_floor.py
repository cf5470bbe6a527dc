"""The floor under the router's added latency: a bare grpc.aio relay, nothing else.

    python -m bench.grpc_relay_floor [--requests 400] [--tokens 8] [--prompt 1500] \\
        [--loops asyncio uvloop] [--modes call mux] [--cores eventengine legacy] \\
        [--out docs/bench/grpc_relay_floor.json]

The router's added latency (bench.router_harness: client TTFT minus the worker's own time)
is two gRPC hops in Python: the client's stream into the router, the router's stream into a
decode worker, and the first token back along both. This measures what those two hops cost
with no router in them, laid out as the harness lays the router out:

- a **server** (the worker's place): a grpc.aio server with one unary-stream method that
  answers each request with `--tokens` small messages at once;
- a **relay** (the router's place), in its own process pinned to CPU 0 with ``taskset``: a
  grpc.aio server whose method opens the same call on the server over one kept channel and
  yields what it reads, message by message, and nothing else (no parsing: bytes in, bytes
  out); with `--modes mux` also a relay that sends every request as a message on one long-lived
  stream-stream call to the server and hands each reply to its request by a number on it
  (the router's way to a decode worker: DecodeWorker.Session), no call set up per request;
- the **client** (the load generator's place), in this process, pinned with the server to the
  other CPU(s): one request at a time, a `--prompt`-token request (int32 ids, as the router's
  proto carries them), TTFT measured at the client.

Per relay (loop implementation x mode; the relay's asyncio loop: the standard one, and
uvloop where it is installed; it is not a dependency of pdserve), interleaved in rounds:
TTFT p50/p99 direct (client -> server) and relayed (client -> relay -> server), their
difference (what one relay hop adds), and the relay's CPU time per request (/proc). With
`--cores`, each relay also runs on each grpc core named (`CORES`: the EventEngine, grpc's
default, or the long-standing I/O manager pdserve's processes use, `pdserve.rpc.core_env`). The
router's own added latency over this floor is what the router does beyond relaying.

With `--cxx`, the same relay compiled (bench/relay_cxx/relay.cc: grpc++'s callback API, bytes
in, bytes out, in each of --modes) runs beside the Python ones, pinned the same way: the floor
of a relay with no Python on the path. It is built here on first use (g++ and grpc++'s
headers: Debian's libgrpc++-dev; `pkg-config grpc++`) into ~/.cache/pdserve/relay_cxx/.

With `--decide N` (mux mode), every relay also makes a routing decision per request before it
forwards it: the request's ids read into a list, then `router.placement.place` (policy
--placement) over a `router.kv_index.KVIndex` of N decode workers holding ~--index-blocks
blocks of bench.router_scale's chat corpus, for that corpus's next prompt (the client's own
prompt is a fixed range, which no cache holds). The Python mux relay calls it on its event
loop; the compiled one is loaded into a Python process as an extension module and calls it
on grpc's thread with the GIL (`_relay.start(..., decide)`): Python decides, compiled code
moves the bytes. Against the plain relays, that is what a decision adds to each.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import hashlib
import importlib.util
import itertools
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from array import array
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from pdserve.cluster import free_port, wait_port
from pdserve.deathsig import guarded
from pdserve.rpc import core_env

METHOD = "/floor.Relay/Generate"
SESSION = "/floor.Relay/Session"
_IDENT = (lambda b: b, lambda b: b)  # bytes in, bytes out: no (de)serialization


def _handler(fn: Any, session: Any = None) -> grpc.GenericRpcHandler:
    methods = {"Generate": grpc.unary_stream_rpc_method_handler(
        fn, request_deserializer=_IDENT[0], response_serializer=_IDENT[1])}
    if session is not None:
        methods["Session"] = grpc.stream_stream_rpc_method_handler(
            session, request_deserializer=_IDENT[0], response_serializer=_IDENT[1])
    return grpc.method_handlers_generic_handler("floor.Relay", methods)


class _Mux:
    """The relay's side of one multiplexed stream to the server: every request is a message
    on it (a 4-byte stream id, then the request), every reply one too (id, a last-message
    byte, the payload); no call is set up per request."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._call = channel.stream_stream(SESSION, request_serializer=_IDENT[0],
                                           response_deserializer=_IDENT[1])()
        self._queues: dict[int, asyncio.Queue[bytes | None]] = {}
        self._ids = 0
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._call:
            q = self._queues.get(int.from_bytes(msg[:4], "little"))
            if q is not None:
                q.put_nowait(msg[5:])
                if msg[4]:
                    q.put_nowait(None)

    async def generate(self, request: bytes) -> Any:
        self._ids += 1
        sid = self._ids
        q = self._queues[sid] = asyncio.Queue()
        try:
            await self._call.write(sid.to_bytes(4, "little") + request)
            while (msg := await q.get()) is not None:
                yield msg
        finally:
            del self._queues[sid]


def decision_world(workers: int, index_blocks: int, placement: str,
                   seed: int = 1) -> Callable[[bytes], bytes]:
    """A per-request routing decision as the router makes it (see --decide): returns the
    request unchanged once decided."""
    from bench import router_scale as rs
    from pdserve.types import LatencyClass
    from router.placement import DecodeTable, place
    from router.policy import RouterPolicy

    rng = random.Random(seed)
    cfg = dataclasses.replace(rs.Config(), index_blocks=index_blocks)
    corpus = rs.build_corpus(rng, cfg)
    prompts = rs.decision_requests(rng, corpus, 4000)
    held = rs.assign_blocks(random.Random(seed * 1000 + workers), corpus, workers)
    index, _ = rs.build_index(held, rs.worker_ids(workers))
    del held, corpus
    decoders, prefills, placed = rs.fleet(random.Random(seed + workers), workers)
    policy, table = RouterPolicy(placement=placement), DecodeTable()  # type: ignore[arg-type]
    standard = LatencyClass.STANDARD
    turn = itertools.cycle(prompts)
    gc.collect()
    gc.freeze()  # as the router does once started (pdserve.service.freeze_startup_heap)

    def decide(request: bytes) -> bytes:
        ids = array("i")
        ids.frombytes(request)
        ids.tolist()  # the prompt read, as the router's request decoder hands it over
        place(next(turn).tolist(), standard, decoders, prefills, index, placed, policy,
              table=table)
        return request

    return decide


async def _serve(port: int, upstream: int | None, tokens: int, mux: bool = False,
                 decide: Callable[[bytes], bytes] | None = None) -> None:
    server = grpc.aio.server()
    session = None
    if upstream is None:
        async def generate(request: bytes, context: Any) -> Any:
            for i in range(tokens):
                yield i.to_bytes(4, "little") * 4

        async def session(requests: Any, context: Any) -> Any:
            async for request in requests:
                for i in range(tokens):
                    yield request[:4] + bytes([i == tokens - 1]) + i.to_bytes(4, "little") * 4
    elif mux:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{upstream}")
        state: dict[str, _Mux] = {}

        async def generate(request: bytes, context: Any) -> Any:
            if "mux" not in state:
                state["mux"] = _Mux(channel)
            if decide is not None:
                request = decide(request)
            async for msg in state["mux"].generate(request):
                yield msg
    else:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{upstream}")
        call_upstream = channel.unary_stream(METHOD, request_serializer=_IDENT[0],
                                             response_deserializer=_IDENT[1])

        async def generate(request: bytes, context: Any) -> Any:
            async for msg in call_upstream(request, timeout=30):
                yield msg
    server.add_generic_rpc_handlers((_handler(generate, session),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", type=int, default=None)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--loop", default="asyncio")
    p.add_argument("--mux", action="store_true")
    p.add_argument("--decide", type=int, default=0, help="workers in the decision's index")
    p.add_argument("--index-blocks", type=int, default=1_000_000)
    p.add_argument("--placement", default="cost")
    p.add_argument("--cxx-module", type=Path, default=None,
                   help="run the compiled relay's extension module (this file) instead")
    a = p.parse_args(argv)
    decide = decision_world(a.decide, a.index_blocks, a.placement) if a.decide else None
    if a.cxx_module is not None:
        spec = importlib.util.spec_from_file_location("_relay", a.cxx_module)
        assert spec is not None and spec.loader is not None
        relay = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(relay)
        relay.start(a.port, a.upstream, a.mux, decide)
        while True:  # the relay runs on its own threads; this one only keeps the process
            time.sleep(3600)
    factory = None
    if a.loop == "uvloop":
        import uvloop
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve(a.port, a.upstream, a.tokens, a.mux, decide))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --cores: the relay's grpc core, as its process environment sets it (`pdserve.rpc.core_env`).
CORES = {"eventengine": {"GRPC_EXPERIMENTS": ""}, "legacy": core_env.DEFAULTS}


def _pinned(argv: list[str], cpus: str, port: int, what: str, *,
            env: dict[str, str] | None = None, within_s: float = 30
            ) -> subprocess.Popen[bytes]:
    """`argv` on CPUs `cpus`, dying with this process, once it listens on `port`."""
    proc = subprocess.Popen(["taskset", "-c", cpus, *guarded(argv)],
                            cwd=Path(__file__).parents[1], env=env)
    wait_port(port, proc, within_s, what)
    return proc


def _start(port: int, cpus: str, *extra: str, core: str | None = None,
           within_s: float = 30) -> subprocess.Popen[bytes]:
    return _pinned([sys.executable, "-m", "bench.grpc_relay_floor", "serve", "--port",
                    str(port), *extra], cpus, port, "relay floor server",
                   env=(os.environ | CORES[core]) if core else None, within_s=within_s)


CXX_SOURCE = Path(__file__).parent / "relay_cxx" / "relay.cc"


def build_cxx_relay(module: bool = False) -> Path:
    """The compiled relay (`module`: as a Python extension module), built once per version of
    its source (CalledProcessError or FileNotFoundError where g++ or grpc++'s headers are
    missing)."""
    src = CXX_SOURCE.read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve"
    name = f"relay-{hashlib.sha256(src).hexdigest()[:12]}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") if module else ""
    exe = cache / "relay_cxx" / f"{name}{suffix}"
    if exe.exists():
        return exe
    flags = shlex.split(subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++"],
                                       check=True, capture_output=True, text=True).stdout)
    if module:
        flags = ["-shared", "-fPIC", "-DRELAY_PYTHON",
                 f"-I{sysconfig.get_paths()['include']}", *flags]
    exe.parent.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_name(exe.name + ".tmp")
    subprocess.run([shutil.which("g++") or "g++", "-O2", "-std=c++17", "-o", str(tmp),
                    str(CXX_SOURCE), *flags], check=True)
    tmp.rename(exe)
    return exe


def _start_cxx(exe: Path, port: int, upstream: int, mux: bool) -> subprocess.Popen[bytes]:
    return _pinned([str(exe), "--port", str(port), "--upstream", str(upstream),
                    *(["--mux"] if mux else [])], "0", port, "compiled relay")


async def _ttfts(port: int, request: bytes, n: int) -> list[float]:
    out = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(METHOD, request_serializer=_IDENT[0],
                                    response_deserializer=_IDENT[1])
        for _ in range(n):
            t0 = time.perf_counter()
            first = None
            async for _msg in call(request, timeout=30):
                if first is None:
                    first = time.perf_counter() - t0
            out.append((first or 0.0) * 1e3)
    return out


async def _messages(port: int, request: bytes) -> list[bytes]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(METHOD, request_serializer=_IDENT[0],
                                    response_deserializer=_IDENT[1])
        return [msg async for msg in call(request, timeout=30)]


def _q(xs: list[float], q: float) -> float:
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 3)


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        serve_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--prompt", type=int, default=1500)
    p.add_argument("--loops", nargs="+", default=["asyncio", *(
        ["uvloop"] if importlib.util.find_spec("uvloop") else [])])
    p.add_argument("--modes", nargs="+", choices=("call", "mux"), default=["call"],
                   help="the relay's way to the server: a call per request, or every request "
                        "a message on one multiplexed stream")
    p.add_argument("--cores", nargs="+", choices=sorted(CORES), default=None,
                   help="relays on each of these grpc cores (default: the one this "
                        "process's environment gives; the server and client keep it)")
    p.add_argument("--cxx", action="store_true",
                   help="also the compiled relay (bench/relay_cxx), in each of --modes")
    p.add_argument("--decide", type=int, default=0, metavar="N",
                   help="also the mux relays (Python, and compiled with --cxx) with a routing "
                        "decision per request over N decode workers")
    p.add_argument("--index-blocks", type=int, default=1_000_000,
                   help="blocks in the decision's index (--decide)")
    p.add_argument("--placement", choices=("threshold", "cost"), default="cost",
                   help="the decision's policy (--decide)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    exe = build_cxx_relay() if a.cxx else None
    module = build_cxx_relay(module=True) if a.cxx and a.decide else None
    ncpu = os.cpu_count() or 2
    others = f"1-{ncpu - 1}" if ncpu > 1 else "0"
    os.sched_setaffinity(0, set(range(1, ncpu)) if ncpu > 1 else {0})
    request = array("i", range(a.prompt)).tobytes()
    sport = free_port()
    procs = [_start(sport, others, "--tokens", str(a.tokens))]
    relays = {}
    try:
        for loop in a.loops:
            for mode in a.modes:
                for core in a.cores or [None]:
                    port = free_port()
                    procs.append(_start(port, "0", "--upstream", str(sport), "--loop", loop,
                                        *(["--mux"] if mode == "mux" else []), core=core))
                    name = "/".join(x for x in (loop, None if mode == "call" else mode, core)
                                    if x)
                    relays[name] = (port, procs[-1].pid)
        if exe is not None:
            for mode in a.modes:
                port = free_port()
                procs.append(_start_cxx(exe, port, sport, mode == "mux"))
                relays["cxx" + ("" if mode == "call" else "/mux")] = (port, procs[-1].pid)
        if a.decide:
            world = ["--decide", str(a.decide), "--index-blocks", str(a.index_blocks),
                     "--placement", a.placement]
            for name, extra in (("asyncio/mux/decide", []),
                                ("cxx/mux/decide", ["--cxx-module", str(module)])):
                if extra and module is None:
                    continue
                port = free_port()
                procs.append(_start(port, "0", "--upstream", str(sport), "--mux", *world,
                                    *extra, within_s=600))
                relays[name] = (port, procs[-1].pid)
        direct: list[float] = []
        relayed: dict[str, list[float]] = {k: [] for k in relays}
        cpu: dict[str, float] = dict.fromkeys(relays, 0.0)
        per = max(1, a.requests // a.rounds)
        asyncio.run(_ttfts(sport, request, 20))  # warm
        want = asyncio.run(_messages(sport, request))
        for name, (port, _pid) in relays.items():
            asyncio.run(_ttfts(port, request, 20))
            if (got := asyncio.run(_messages(port, request))) != want:
                raise SystemExit(f"relay {name} changed the stream: {got[:3]} against "
                                 f"{want[:3]}")
        for _ in range(a.rounds):
            direct += asyncio.run(_ttfts(sport, request, per))
            for loop, (port, pid) in relays.items():
                c0 = _cpu_s(pid)
                relayed[loop] += asyncio.run(_ttfts(port, request, per))
                cpu[loop] += _cpu_s(pid) - c0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text()
                  .splitlines() if ln.startswith("flags")), [])
    result: dict[str, Any] = {
        "bench": "bench/grpc_relay_floor.py", "command": " ".join(sys.argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "machine": {"cpu": platform.processor() or _model_name(), "cpus": ncpu,
                    "avx512f": "avx512f" in flags, "python": platform.python_version(),
                    "grpc": grpc.__version__},
        "config": vars(a) | {"out": str(a.out) if a.out else None},
        "direct_ttft_ms": {"p50": _q(direct, 0.5), "p99": _q(direct, 0.99),
                           "mean": round(statistics.mean(direct), 3)},
        "relayed": {}}
    for loop, xs in relayed.items():
        result["relayed"][loop] = {
            "ttft_ms": {"p50": _q(xs, 0.5), "p99": _q(xs, 0.99),
                        "mean": round(statistics.mean(xs), 3)},
            "added_ms_p50": round(_q(xs, 0.5) - _q(direct, 0.5), 3),
            "relay_cpu_ms_per_request": round(cpu[loop] / len(xs) * 1e3, 3)}
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


def _model_name() -> str:
    for ln in Path("/proc/cpuinfo").read_text().splitlines():
        if ln.startswith("model name"):
            return ln.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    main()
