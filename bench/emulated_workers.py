"""Many emulated decode workers in one process, for the router load harness.

    python -m bench.emulated_workers --workers 64 --namespace NS [--index-blocks 1000000]

Each worker is the real decode worker stack over an emulated engine
(`bench.emulated_engine.EmulatedEngine`): `decode_svc.worker.DecodeWorker` behind
`decode_svc.servicer` on its own `grpc.aio` server and port (the cluster-token interceptor and
the same message and call bounds as `decode_svc.main`), its own `WorkerRegistry` lease in
Redis (epoch, signed record, 1 s heartbeats with its engine's load) and its own
`KVEventPublisher` (its opening snapshot, then batched stored / removed events, signed). So
the router talks to them exactly as to real workers; only the model is emulated. All of them
share one asyncio loop.

Redis URL and cluster secret come from the environment as for every pdserve process
(PDSERVE_REDIS_URL, PDSERVE_CLUSTER_SECRET). Before listing itself, every worker's prefix
cache is filled with its share of a chat corpus (`build_corpus`, deterministic from
`--seed`, so the harness can continue those conversations), so the router's index holds
about `--index-blocks` blocks once it has read the opening snapshots.

Protocol on stdin/stdout (one JSON line each): after start-up one line
``{"ready": true, "workers": [...], "blocks": ..., ...}``; then commands ``dump PATH`` (write
the per-request records since the last dump to PATH, answer ``{"dumped": n, ...}``),
``digest PATH`` (every worker's cached block hashes, hex, to PATH) and ``quit``. A record
is what the worker saw of one request: its id, the worker, when its Generate reached the
worker and when its first token left the engine (CLOCK_MONOTONIC, shared by every process
of the machine), its prompt length, the prompt tokens the chosen
worker's cache held when the request arrived, and the most any worker's cache held then (the
oracle: `CacheOracle`, updated with every cache change of every worker, not via Redis).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import sys
import time
from array import array
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from prometheus_client import CollectorRegistry

from bench.emulated_engine import VOCAB, CacheOracle, EmulatedEngine
from bench.sim.workers import StepCost
from decode_svc import servicer as decode_servicer
from decode_svc.metrics import DecodeMetrics
from decode_svc.worker import DecodeWorker
from pdserve.control.kv_events import KVEventPublisher, KVEventStreams
from pdserve.control.load import WorkerLoad
from pdserve.control.registry import WorkerRegistry
from pdserve.control.signing import signer_for
from pdserve.control.workers import WorkerInfo
from pdserve.engine.block_manager import block_hashes
from pdserve.rpc import auth, transport
from pdserve.rpc.auth import ClusterSecret
from pdserve.runtime import start_server
from pdserve.types import GenerateRequest, TokenEvent
from pdserve.worker_config import default_max_concurrent_rpcs, default_max_message_bytes

SERVICE = "pdserve.v1.DecodeWorker"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
T = TypeVar("T")

# ---------------------------------------------------------------------- the chat corpus


@dataclass
class Corpus:
    systems: list[array]  # shared system prompts
    # (home worker index, full history: system prompt + turns), cached on the home worker
    conversations: list[tuple[int, array]]


def build_corpus(seed: int, workers: int, index_blocks: int, *, systems: int = 256,
                 max_history: int = 6000) -> Corpus:
    """Deterministic from its arguments (the harness builds the same one). Each worker gets
    conversations until ~index_blocks / workers blocks: a shared system prompt (100-1000
    tokens, one of `systems`), then 1-12 turns of user (50-200) and assistant (100-300)
    tokens, at most `max_history` tokens."""
    rng = np.random.default_rng(seed)
    sys_prompts = [array("i", rng.integers(0, VOCAB, int(rng.integers(100, 1001)),
                                           dtype=np.int32).tobytes())
                   for _ in range(systems)]
    per_worker = index_blocks // max(workers, 1)
    convs: list[tuple[int, array]] = []
    for w in range(workers):
        blocks = 0
        while blocks < per_worker:
            s = sys_prompts[int(rng.integers(0, systems))]
            turns = int(rng.integers(1, 13))
            n = sum(int(rng.integers(50, 201)) + int(rng.integers(100, 301))
                    for _ in range(turns))
            n = min(n, max_history - len(s))
            h = array("i", s)
            h.frombytes(rng.integers(0, VOCAB, n, dtype=np.int32).tobytes())
            convs.append((w, h))
            blocks += n // BLOCK_SIZE  # its own blocks; the system prompt's may be shared
    return Corpus(sys_prompts, convs)


# ---------------------------------------------------------------------- one worker


@dataclass
class Record:
    request_id: str
    worker: str
    t_recv: float
    t_first: float
    prompt_tokens: int
    cached_tokens: int  # on this worker's cache when the request arrived
    oracle_tokens: int  # the most any worker's cache held then
    output_tokens: int = 0
    t_done: float = 0.0


class _NoKVReceiver:
    """Decode workers here take local prefills only: nothing is ever transferred."""

    descriptor_id = ""
    address = ""

    def expect(self, *a: object, **k: object) -> Any:
        raise RuntimeError("emulated workers take no remote prefill")

    async def cancel(self, *a: object, **k: object) -> None:
        return None


class RecordingDecodeWorker(DecodeWorker):
    """The real DecodeWorker; `generate` also notes when the request arrived and when its
    first token left the engine, and what the caches held at its arrival."""

    def __init__(self, *args: Any, records: list[Record], oracle: CacheOracle,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records = records
        self.oracle = oracle

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        t_recv = time.monotonic()
        eng: EmulatedEngine = self.engine  # type: ignore[assignment]
        hashes = block_hashes(req.token_ids, BLOCK_SIZE, eng.block_manager.hash_extra)
        rec = Record(req.request_id, self.worker_id, t_recv, 0.0, len(req.token_ids),
                     eng.cached_tokens_now(hashes),
                     self.oracle.best_blocks(hashes) * BLOCK_SIZE)
        first = True
        async for ev in super().generate(req):
            if first:
                rec.t_first = time.monotonic()
                first = False
            if ev.finished:
                rec.output_tokens = ev.num_output_tokens
                rec.t_done = time.monotonic()
                self.records.append(rec)
            yield ev


@dataclass
class Emulated:
    engine: EmulatedEngine
    worker: RecordingDecodeWorker
    server: Any
    registry: WorkerRegistry
    publisher: KVEventPublisher
    address: str


def make_engine(i: int, *, prefix: str, model_id: str, num_blocks: int, cost: StepCost,
                time_scale: float, oracle: CacheOracle, warm: list[array]) -> EmulatedEngine:
    """The engine of worker `i`, its cache filled with `warm` (no I/O: before any worker
    talks to Redis, so filling never stalls another worker's lease)."""
    engine = EmulatedEngine(worker_id=f"{prefix}-{i:03d}", model_id=model_id,
                            num_blocks=num_blocks, block_size=BLOCK_SIZE,
                            max_model_len=MAX_MODEL_LEN, cost=cost, time_scale=time_scale,
                            oracle=oracle)
    for k, hist in enumerate(warm):
        engine.warm(hist.tolist(), f"warm-{k}")
    return engine


async def start_worker(engine: EmulatedEngine, *, model_id: str, redis_url: str,
                       namespace: str, secret: ClusterSecret | None, oracle: CacheOracle,
                       records: list[Record], max_requests: int = 256) -> Emulated:
    worker_id = engine.worker_id
    await engine.start()
    registry = WorkerRegistry.from_url(redis_url, namespace=namespace,
                                       signer=signer_for(secret, namespace))
    epoch = await registry.next_epoch(worker_id)
    worker = RecordingDecodeWorker(engine, _NoKVReceiver(), worker_id=worker_id,  # type: ignore[arg-type]
                                   max_requests=max_requests,
                                   metrics=DecodeMetrics(CollectorRegistry()),
                                   records=records, oracle=oracle)
    server = transport.new_server(
        auth=auth.cluster_interceptor(secret),
        max_message_bytes=default_max_message_bytes(MAX_MODEL_LEN),
        max_concurrent_rpcs=default_max_concurrent_rpcs(max_requests))
    decode_servicer.add_to_server(worker, server)
    health = await transport.add_health(server, SERVICE)
    bound = await start_server(server, "127.0.0.1", 0, None)
    address = f"127.0.0.1:{bound.rpartition(':')[2]}"

    def load() -> WorkerLoad:
        return dataclasses.replace(worker.load())

    info = WorkerInfo(worker_id=worker_id, role="decode", grpc_address=address,
                      model_id=model_id, epoch=epoch, started_at=time.time(), load=load())
    publisher = KVEventPublisher(KVEventStreams(registry), engine, lambda: engine.kv_event_count,
                                 worker_id=worker_id, epoch=epoch, block_size=BLOCK_SIZE)
    await publisher.start()  # the opening snapshot, before the worker is listed
    await registry.register(info, 3.0, heartbeat_s=1.0, load_fn=load)
    await transport.set_serving(health, SERVICE)
    return Emulated(engine, worker, server, registry, publisher, address)


async def stop_worker(w: Emulated) -> None:
    await w.registry.deregister()
    await w.server.stop(grace=1.0)
    await w.publisher.close()
    await w.engine.close()
    await w.registry.close()


# ---------------------------------------------------------------------- the process


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def serve(args: argparse.Namespace) -> None:
    from pdserve.cluster import CLUSTER_SECRET_ENV, REDIS_URL_ENV

    redis_url = os.environ[REDIS_URL_ENV]
    raw = os.environ.get(CLUSTER_SECRET_ENV, "")
    secret = ClusterSecret(raw.encode()) if raw else None
    corpus = build_corpus(args.seed, args.workers, args.index_blocks)
    warm: list[list[array]] = [[] for _ in range(args.workers)]
    for home, hist in corpus.conversations:
        warm[home].append(hist)
    per_worker = args.index_blocks // max(args.workers, 1)
    num_blocks = max(args.min_blocks, int(per_worker * args.headroom) + 1024)
    cost = StepCost.load()
    oracle = CacheOracle()
    records: list[Record] = []
    t0 = time.monotonic()
    engines = [make_engine(i, prefix=args.prefix, model_id=args.model_id,
                           num_blocks=num_blocks, cost=cost, time_scale=args.time_scale,
                           oracle=oracle, warm=warm[i])
               for i in range(args.workers)]
    del corpus, warm
    # A million cached blocks are a million long-lived objects (the oracle's sets): left to
    # the cyclic GC, each full collection walks them all and stalls every worker's loop.
    gc.collect()
    gc.freeze()
    warm_s = time.monotonic() - t0
    sem = asyncio.Semaphore(8)

    async def one(engine: EmulatedEngine) -> Emulated:
        async with sem:
            return await start_worker(engine, model_id=args.model_id, redis_url=redis_url,
                                      namespace=args.namespace, secret=secret, oracle=oracle,
                                      records=records)

    workers = list(await asyncio.gather(*(one(e) for e in engines)))
    cached = sum(len(w.engine.block_manager.cached_hashes()) for w in workers)
    _say({"ready": True, "workers": [w.engine.worker_id for w in workers],
          "addresses": [w.address for w in workers], "cached_blocks": cached,
          "distinct_blocks": len(oracle.holders), "blocks_per_worker": num_blocks,
          "warm_s": round(warm_s, 2), "start_s": round(time.monotonic() - t0, 2),
          "pid": os.getpid()})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = (await reader.readline()).decode().strip()
        if not line or line == "quit":
            break
        cmd, _, arg = line.partition(" ")
        if cmd == "dump":
            # Taken on the loop, so the records, caches and counters are one moment's; written
            # in a thread, so the workers' heartbeats and events go on meanwhile.
            taken, records[:] = list(records), []
            engines = [w.engine for w in workers]
            reply = {"dumped": len(taken),
                     "steps": sum(e.num_steps for e in engines),
                     "step_seconds": round(sum(e.step_seconds for e in engines), 3),
                     "preemptions": sum(e.num_preemptions for e in engines),
                     "kv_ops_published": sum(w.publisher.published_ops for w in workers),
                     "kv_batches_published": sum(w.publisher.published_batches
                                                 for w in workers),
                     "snapshots": sum(w.publisher.snapshots for w in workers),
                     "cached_blocks": sum(len(e.block_manager.cached_hashes())
                                          for e in engines),
                     "distinct_blocks": len(oracle.holders)}
            await asyncio.to_thread(_write_json, arg, _record_rows, taken)
            _say(reply)
        elif cmd == "digest":
            # A million hashes to hex, sort and write take seconds: done on the loop, they
            # stalled every worker's heartbeat past its lease (the router then dropped them
            # all, by design). The snapshot is one moment's; the rest runs in a thread.
            held = {w.engine.worker_id: w.engine.block_manager.cached_hashes() for w in workers}
            await asyncio.to_thread(_write_json, arg, cache_digest, held)
            _say({"digest": arg})
    await asyncio.gather(*(stop_worker(w) for w in workers), return_exceptions=True)


def cache_digest(held: dict[str, list[bytes]]) -> dict[str, list[str]]:
    """Every worker's cached block hashes (hex), sorted: what the index must equal."""
    return {w: sorted(h.hex() for h in hs) for w, hs in held.items()}


def _record_rows(records: list[Record]) -> list[tuple[Any, ...]]:
    return [dataclasses.astuple(r) for r in records]


def _write_json(path: str, build: Callable[[T], object], arg: T) -> None:
    """`build(arg)` written to `path` as JSON (in a thread: both may take seconds)."""
    with open(path, "w") as f:
        json.dump(build(arg), f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--namespace", required=True)
    p.add_argument("--model-id", required=True, help="the router's model id")
    p.add_argument("--prefix", default="emu")
    p.add_argument("--index-blocks", type=int, default=0,
                   help="prefix blocks to leave in the workers' caches before they list")
    p.add_argument("--headroom", type=float, default=1.25,
                   help="pool size per worker = its warm blocks x this + 1024")
    p.add_argument("--min-blocks", type=int, default=4096)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="every step lasts the profile's time for it x this")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    from pdserve.runtime import configure_logging

    configure_logging("WARNING")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
