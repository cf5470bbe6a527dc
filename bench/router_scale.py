"""Router at scale: placement decisions, the prefix index's memory, KV event intake, hit rate.

    python -m bench.router_scale [--quick] [--out docs/bench/router_scale.json]

What is measured, and how (one process on this machine, plus a redis-server and one
publisher process for section 3; nothing is mocked in the code under test):

1. **Decision throughput and latency** of `router.placement.place`, the exact call the router
   makes per request (hash the prompt, walk `router.kv_index.KVIndex`, score every decode
   worker with `router.policy.choose_decode`, decide local vs remote), for N = 1, 8, 64, 256
   decode workers. The index holds ~1M distinct blocks (block size 16, extra key = the model
   id), built from a chat corpus: 256 shared system prompts (100-1000 tokens) x
   conversations of 1-12 turns (user 50-200, assistant 100-300 tokens each). Every
   conversation's history is cached on one random worker, 10% also hold a prefix of it on a
   second one, so workers share system prompts. Each worker's blocks reach the index as its
   KV event batches would: a snapshot in chunks of 4096 ops, through the real codec
   (`KVEventBatch.to_fields` / `from_fields`) and `KVIndex.apply`. The request stream: 60%
   a new turn of a cached conversation (its history up to some turn + 50-200 new tokens),
   30% a new conversation on a known system prompt, 10% an unrelated prompt (200-4000
   tokens). Worker loads, in-flight counts and 4 prefill workers' backlogs are random but
   fixed. The process is pinned to one core (`sched_setaffinity`) and GC is left on as in
   the router; each prompt becomes a fresh list of fresh ints just before its call (as the
   router's request decoder hands it over), each call is timed with `perf_counter_ns`, after
   a warm-up; 5 timed passes going round the Ns (every N's index is built first), the
   median one reported, with how busy the pinned core was with other processes meanwhile
   (/proc/stat). decisions/s = 1 / mean latency. `--placement cost` places by the router's
   default policy (4 prefill workers, no CPUs shared), `--cold-kib K` reads K KiB between
   two timed calls (untimed), so each decision runs with its caches cold as in the router,
   where gRPC, the KV event intake and the loop run between two. At N = 64
   the parts are timed on their own: hashing (`block_hashes`) and `KVIndex.match`; the rest
   of `place` is the difference. cProfile of `place` at 64 and 256 workers shows where it
   goes.
2. **Index memory** at ~1M blocks: `KVIndex.memory_bytes()` and tracemalloc's growth while the
   index is built from decoded batches (the hash bytes are fresh objects, as in the router).
3. **KV events absorbed per second** through real Redis: a private redis-server on a free
   port (no persistence); a publisher process (`--publisher`, spawned from this script)
   runs 64 real `BlockManager`s (4096 blocks each, so they evict) driven by an interleaved
   multi-turn chat stream (each conversation stays on one worker, 256 requests in flight),
   and publishes each request's drained events with `KVEventStreams.publish` (per worker:
   a snapshot numbered 1, then 2, 3, ...). This process runs one `KVIndexFollower` (its
   default XREAD count and block time) folding into a `KVIndex`: once *live* while the
   publisher runs, then again with a fresh index draining the whole backlog (the follower's
   capacity: Redis serves entries already there). The follower is pinned to one core, the
   publisher and redis-server to the other. Rates are ops folded into the index per second
   of wall time, and per CPU second of the follower process. At the end the publisher
   prints (JSON on stdout) a blake2b digest of each worker's sorted cached hashes; both
   indexes must equal them, with no resync.
4. **Prefix-hit rate vs an oracle** at 64 decode workers, each a real `BlockManager` of 2048
   blocks: 32 system prompts (300-800 tokens) shared by many users, conversations of 3-8
   turns (user 50-200, assistant 100-300 tokens), 256 open at a time and interleaved. A
   placed request allocates its prompt, gets its reply's slots, registers its full blocks,
   and is freed K decisions later (K = `--lag`, default 4); `running` = its worker's
   requests still in flight. Policies: `index` (`place` over a KVIndex fed by the workers'
   events, each request's batch applied when it finishes, K decisions later), `oracle` (the
   same scoring, `choose_decode`, with each worker's real `num_cached_tokens` at decision
   time), `load_only` (fewest running, ties at random), `round_robin`, `random`. Hit rate =
   prompt tokens cached at the chosen worker when the decision is made / prompt tokens.
   The index must equal the workers' caches once every batch is applied. The full run adds
   K = 64 (one request in flight per worker on average) for every policy, and the index
   policy with requests in flight for 64 decisions but events arriving after 4 (a worker
   publishes stored blocks when its prefill ends, not when the request finishes).

Targets reported against: >= 10,000 decisions/s, p50 <= 0.5 ms, p99 <= 2 ms at 64 and 256
workers with a 1M-block index; the index policy within 3% of the oracle and above load-only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import hashlib
import itertools
import json
import os
import platform
import pstats
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
import redis.utils

from pdserve.cluster import free_port
from pdserve.control.kv_events import MAX_OPS_PER_ENTRY, KVEventStreams
from pdserve.control.load import WorkerLoad
from pdserve.control.registry import WorkerRegistry
from pdserve.control.workers import WorkerInfo
from pdserve.engine.block_manager import BlockHash, BlockManager, block_hashes
from pdserve.errors import ControlPlaneError
from pdserve.kv_events import KVEventBatch, KVOp
from pdserve.types import LatencyClass
from router.kv_follow import KVIndexFollower
from router.kv_index import Applied, KVIndex
from router.placement import DecodeTable, place
from router.policy import DecodeCandidate, RouterPolicy, choose_decode

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
MODEL_ID = "bench-router-scale/chat-8b"
EXTRA = MODEL_ID.encode()
PUBLISH_CHUNK = 4096  # ops per stream entry, as KVEventPublisher's default max_ops
TARGET_DECISIONS_PER_S = 10_000.0
# One decode worker's heartbeat (a new WorkerInfo) every this many decisions: 64 workers'
# 1 s heartbeats against the target rate.
HEARTBEAT_EVERY = 156
TARGET_P50_MS = 0.5
TARGET_P99_MS = 2.0
TARGET_ORACLE_GAP = 0.03
TIMEOUT_S = 120.0  # any single wait (redis start, publisher, follower catching up)


@dataclass(frozen=True)
class Config:
    # 1 and 2: decisions and memory
    index_blocks: int = 1_000_000
    worker_counts: tuple[int, ...] = (1, 8, 64, 256)
    decision_requests: int = 3000
    warmup: int = 200
    rounds: int = 5  # timed passes over the requests per N; the median one is reported
    profile_requests: int = 400
    split_workers: int = 64
    placement: str = "threshold"  # the policy placed by (--placement)
    # Bytes (KiB) read between two timed decisions, untimed (--cold-kib): the router runs
    # each decision with its caches cold (the gRPC threads, the KV event intake and the
    # loop run in between); 0: back to back, warm.
    cold_kib: int = 0
    corpus_systems: int = 256
    # 3: events through Redis
    events_workers: int = 64
    events_ops: int = 500_000
    events_blocks_per_worker: int = 4096
    events_inflight: int = 256
    # 4: hit rate
    hit_workers: int = 64
    hit_blocks_per_worker: int = 2048
    hit_requests: int = 6000
    hit_systems: int = 32
    hit_open_conversations: int = 256
    hit_lag: int = 4  # K: decisions a request stays in flight, and its events' lag
    # More (in flight, event lag) runs: every policy once per in-flight value (lag = K), the
    # index policy alone for a different lag.
    hit_extra: tuple[tuple[int, int], ...] = ((64, 64), (64, 4))
    seed: int = 1


QUICK = Config(index_blocks=100_000, decision_requests=400, warmup=50, rounds=1,
               profile_requests=100, corpus_systems=64, events_ops=40_000, hit_requests=1500,
               hit_blocks_per_worker=512, hit_open_conversations=128, hit_extra=())


# --------------------------------------------------------------------------- workload


def draw_tokens(rng: random.Random, n: int) -> array[int]:
    return array("H", rng.randbytes(2 * n))


@dataclass
class Conversation:
    cid: int
    system: int
    tokens: array[int]  # the whole history: system prompt, then user and assistant turns
    turns: list[tuple[int, int]]  # per turn: (prompt length, length after the reply)
    hashes: list[BlockHash]  # chained hashes of every full block of `tokens`


@dataclass(frozen=True)
class ChatSpec:
    turns: tuple[int, int] = (3, 8)
    user: tuple[int, int] = (50, 200)
    assistant: tuple[int, int] = (100, 300)
    max_prompt: int = 4000


def make_systems(rng: random.Random, n: int, lo: int, hi: int) -> list[array[int]]:
    return [draw_tokens(rng, rng.randint(lo, hi)) for _ in range(n)]


def make_conversation(rng: random.Random, cid: int, systems: Sequence[array[int]],
                      spec: ChatSpec) -> Conversation:
    system = rng.randrange(len(systems))
    tokens = array("H", systems[system])
    turns: list[tuple[int, int]] = []
    for _ in range(rng.randint(*spec.turns)):
        user = rng.randint(*spec.user)
        if turns and len(tokens) + user > spec.max_prompt:
            break
        tokens.extend(draw_tokens(rng, user))
        prompt_len = len(tokens)
        tokens.extend(draw_tokens(rng, rng.randint(*spec.assistant)))
        turns.append((prompt_len, len(tokens)))
    return Conversation(cid, system, tokens, turns, block_hashes(tokens, BLOCK_SIZE, EXTRA))


@dataclass(frozen=True)
class ChatRequest:
    conv: Conversation
    turn: int

    @property
    def prompt_len(self) -> int:
        return self.conv.turns[self.turn][0]

    @property
    def full_len(self) -> int:
        return self.conv.turns[self.turn][1]

    def prompt_hashes(self) -> list[BlockHash]:
        return self.conv.hashes[: self.prompt_len // BLOCK_SIZE]


def chat_stream(rng: random.Random, systems: Sequence[array[int]], spec: ChatSpec,
                open_conversations: int) -> Iterator[ChatRequest]:
    """Endless interleaved turns: a random open conversation sends its next turn; one that
    has sent its last is replaced by a new one."""
    cids = itertools.count()
    open_: list[tuple[Conversation, int]] = [
        (make_conversation(rng, next(cids), systems, spec), 0) for _ in range(open_conversations)]
    while True:
        i = rng.randrange(len(open_))
        conv, turn = open_[i]
        yield ChatRequest(conv, turn)
        if turn + 1 < len(conv.turns):
            open_[i] = (conv, turn + 1)
        else:
            open_[i] = (make_conversation(rng, next(cids), systems, spec), 0)


# --------------------------------------------------------------------------- helpers


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return float(sorted_values[k])


def worker_ids(n: int, role: str = "decode") -> list[str]:
    return [f"{role}-{i:03d}" for i in range(n)]


def digest(hashes: Sequence[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for x in sorted(hashes):
        h.update(x)
    return h.hexdigest()


def snapshot_batches(hashes: Sequence[bytes], *, epoch: int = 1,
                     first_seq: int = 1) -> list[KVEventBatch]:
    """A worker's cache as KVEventPublisher sends it: the first chunk is the snapshot."""
    ops = [(KVOp.STORED, h) for h in hashes]
    chunks = [ops[i : i + PUBLISH_CHUNK] for i in range(0, len(ops), PUBLISH_CHUNK)] or [[]]
    return [KVEventBatch(epoch, first_seq + i, BLOCK_SIZE, tuple(c), snapshot=i == 0)
            for i, c in enumerate(chunks)]


def machine() -> dict[str, Any]:
    model, flags = platform.processor() or platform.machine(), set[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == (platform.processor()
                                                         or platform.machine()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    commit = dirty = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    return {
        "cpu_model": model,
        "cpu_flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")},
        "cpus_online": os.cpu_count(),
        "cpus_usable": sorted(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "redis_py": redis.__version__,
        "hiredis": bool(redis.utils.HIREDIS_AVAILABLE),
        "git_commit": commit,
        "git_dirty": dirty,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


class Interference:
    """How busy a core (None: the machine) was with other processes' work while a block
    ran: its busy time from /proc/stat minus this process's CPU time, and steal time."""

    def __init__(self, core: int | None):
        self.core = core
        self.result: dict[str, float] = {}

    def __enter__(self) -> Interference:
        self._start = (cpu_jiffies(self.core), time.process_time(), time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        (busy0, steal0), cpu0, wall0 = self._start
        busy1, steal1 = cpu_jiffies(self.core)
        hz = os.sysconf("SC_CLK_TCK")
        wall = time.perf_counter() - wall0
        own = time.process_time() - cpu0
        others = max(0.0, (busy1 - busy0) / hz - own)
        cpus = 1 if self.core is not None else len(os.sched_getaffinity(0)) or 1
        self.result = {"wall_s": round(wall, 3), "own_cpu_s": round(own, 3),
                       "others_busy_share": round(others / wall / cpus, 3) if wall else 0.0,
                       "steal_share": round((steal1 - steal0) / hz / wall / cpus, 3)
                       if wall else 0.0}


def cpu_jiffies(core: int | None) -> tuple[int, int]:
    """(busy, steal) clock ticks of one CPU, or all, from /proc/stat."""
    name = "cpu" if core is None else f"cpu{core}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/stat").read_text().splitlines():
            parts = line.split()
            if parts and parts[0] == name:
                v = [int(x) for x in parts[1:9]] + [0] * 8
                user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
                return user + nice + system + irq + softirq, steal
    return 0, 0


def loadavg() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "n/a"


# --------------------------------------------------------------------------- 1 + 2


@dataclass
class Corpus:
    conversations: list[Conversation]
    systems: list[array[int]]
    distinct_blocks: int


def build_corpus(rng: random.Random, cfg: Config) -> Corpus:
    systems = make_systems(rng, cfg.corpus_systems, 100, 1000)
    spec = ChatSpec(turns=(1, 12), max_prompt=3800)
    convs: list[Conversation] = []
    sys_blocks = [len(s) // BLOCK_SIZE for s in systems]
    used: set[int] = set()
    distinct = 0
    while distinct < cfg.index_blocks:
        conv = make_conversation(rng, len(convs), systems, spec)
        convs.append(conv)
        distinct += len(conv.hashes) - sys_blocks[conv.system]
        if conv.system not in used:
            used.add(conv.system)
            distinct += sys_blocks[conv.system]
    return Corpus(convs, systems, distinct)


def decision_requests(rng: random.Random, corpus: Corpus, n: int) -> list[array[int]]:
    out: list[array[int]] = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.6:  # a new turn of a cached conversation
            conv = rng.choice(corpus.conversations)
            t = rng.randrange(len(conv.turns))
            hist = conv.turns[t][1]
            tokens = conv.tokens[:hist] + draw_tokens(rng, rng.randint(50, 200))
        elif kind < 0.9:  # a new conversation on a known system prompt
            tokens = (corpus.systems[rng.randrange(len(corpus.systems))]
                      + draw_tokens(rng, rng.randint(50, 200)))
        else:  # unrelated
            tokens = draw_tokens(rng, rng.randint(200, 4000))
        if len(tokens) > 4300:
            continue
        out.append(tokens)
    return out


def assign_blocks(rng: random.Random, corpus: Corpus, n: int) -> list[list[bytes]]:
    """Each worker's cached hashes, in the order a cache would have stored them."""
    held: list[dict[bytes, None]] = [{} for _ in range(n)]
    for conv in corpus.conversations:
        held[rng.randrange(n)].update(dict.fromkeys(conv.hashes))
        if n > 1 and rng.random() < 0.1:
            k = rng.randint(1, len(conv.hashes))
            held[rng.randrange(n)].update(dict.fromkeys(conv.hashes[:k]))
    return [list(h) for h in held]


def build_index(held: list[list[bytes]], ids: list[str]) -> tuple[KVIndex, dict[str, Any]]:
    """Fold every worker's snapshot into a fresh index through the real codec, measuring
    tracemalloc's growth (only what the index keeps; batches are dropped as they go)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        index = KVIndex()
        for worker_id, hashes in zip(ids, held, strict=True):
            for b in snapshot_batches(hashes):
                decoded = KVEventBatch.from_fields(b.to_fields(), max_ops=MAX_OPS_PER_ENTRY)
                if index.apply(worker_id, decoded) is not Applied.OK:
                    raise RuntimeError(f"building the index: {worker_id} did not apply")
                del decoded
        build_s = time.perf_counter() - t0
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    mem = index.memory_bytes()
    return index, {
        "workers": len(ids),
        "index_blocks": index.num_blocks,
        "index_entries": index.num_entries,
        "memory_bytes": mem,
        "memory_bytes_per_block": mem / max(1, index.num_blocks),
        "tracemalloc_bytes": grown,
        "tracemalloc_bytes_per_block": grown / max(1, index.num_blocks),
        "tracemalloc_bytes_per_entry": grown / max(1, index.num_entries),
        "build_s_under_tracemalloc": round(build_s, 2),
    }


def fleet(rng: random.Random, n: int, n_prefill: int = 4
          ) -> tuple[list[WorkerInfo], list[WorkerInfo], dict[str, int]]:
    now = time.time()
    decoders = [
        WorkerInfo(worker_id=w, role="decode", grpc_address=f"127.0.0.1:{20000 + i}",
                   model_id=MODEL_ID, epoch=1, started_at=now,
                   load=WorkerLoad(running=rng.randint(0, 24), waiting=rng.randint(0, 3),
                                   free_blocks=rng.randint(0, 16384), total_blocks=16384))
        for i, w in enumerate(worker_ids(n))]
    prefills = [
        WorkerInfo(worker_id=w, role="prefill", grpc_address=f"127.0.0.1:{30000 + i}",
                   model_id=MODEL_ID, epoch=1, started_at=now,
                   load=WorkerLoad(running=rng.randint(0, 4), queued=rng.randint(0, 8),
                                   queued_tokens=rng.randint(0, 20000)))
        for i, w in enumerate(worker_ids(n_prefill, "prefill"))]
    placed = {w.worker_id: rng.randint(0, 8) for w in decoders}
    return decoders, prefills, placed


def latency_summary(ns: Sequence[int]) -> dict[str, float]:
    s = sorted(ns)
    mean = sum(s) / len(s)
    return {"mean_us": mean / 1e3, "p50_us": percentile(s, 50) / 1e3,
            "p99_us": percentile(s, 99) / 1e3, "max_us": s[-1] / 1e3}


def time_place(reqs: list[array[int]], decoders: list[WorkerInfo], prefills: list[WorkerInfo],
               index: KVIndex, placed: dict[str, int], policy: RouterPolicy,
               table: DecodeTable, seed: int = 0, evict: Callable[[], object] | None = None
               ) -> tuple[list[int], list[int], list[int]]:
    """Per request: place()'s latency (ns), its CPU time on this thread (ns: time the core
    spent on other processes is not in it) and the cached tokens it found. Each prompt is
    made a fresh list of fresh ints just before its call, as the router's request decoder
    hands it over (not timed). The router's DecodeTable is kept across calls, and every
    HEARTBEAT_EVERY decisions one decode worker's record is replaced by a new one (its
    heartbeat: untimed, the directory's work), so the timed calls rebuild the table as
    often as the router would: 64 heartbeats a second against 10,000 decisions a second.
    `evict`: called before each timed call, untimed (`Config.cold_kib`)."""
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    lat: list[int] = []
    cpu: list[int] = []
    cached: list[int] = []
    latency = LatencyClass.STANDARD
    rng = random.Random(seed)
    for k, arr in enumerate(reqs):
        if k % HEARTBEAT_EVERY == 0:
            j = rng.randrange(len(decoders))
            decoders[j] = replace(decoders[j], load=replace(
                decoders[j].load, running=rng.randint(0, 16)))
        ids = arr.tolist()
        if evict is not None:
            evict()
        c0 = cpu_clock()
        t0 = clock()
        p = place(ids, latency, decoders, prefills, index, placed, policy, table=table)
        t1 = clock()
        cpu.append(cpu_clock() - c0)
        lat.append(t1 - t0)
        cached.append(p.cached_tokens)
    return lat, cpu, cached


def time_split(reqs: list[array[int]], place_ns: Sequence[int], index: KVIndex
               ) -> dict[str, Any]:
    """place()'s parts, timed on their own: the prefix walk (`KVIndex.match_prompt`: hashing
    as far as some worker holds the prompt, fused with the walk; fresh ids, as in place); the
    rest is place()'s time (`place_ns`, timed on its own) minus it. For reference, hashing
    every block of the prompt (`block_hashes`) and the walk over those hashes
    (`KVIndex.match`) are timed too."""
    clock = time.perf_counter_ns
    t_walk: list[int] = []
    t_hash: list[int] = []
    t_match: list[int] = []
    for arr in reqs:
        ids = arr.tolist()
        t0 = clock()
        index.match_prompt(ids, BLOCK_SIZE, EXTRA)
        t1 = clock()
        ids = arr.tolist()
        t2 = clock()
        hashes = block_hashes(ids, BLOCK_SIZE, EXTRA)
        t3 = clock()
        index.match(hashes)
        t4 = clock()
        t_walk.append(t1 - t0)
        t_hash.append(t3 - t2)
        t_match.append(t4 - t3)
    t_place = list(place_ns)
    rest = [p - w for p, w in zip(t_place, t_walk, strict=True)]
    blocks = sum(len(ids) // BLOCK_SIZE for ids in reqs)
    total = sum(t_place)
    out: dict[str, Any] = {"requests": len(reqs), "mean_prompt_blocks": blocks / len(reqs),
                           "native_hashing": native_hashing()}
    for name, xs in (("match_prompt", t_walk), ("rest", rest), ("place", t_place),
                     ("full_hash", t_hash), ("full_match", t_match)):
        s = latency_summary(xs)
        out[name] = {"mean_us": s["mean_us"], "p50_us": s["p50_us"],
                     "share_of_place": sum(xs) / total}
    out["full_hash_ns_per_block"] = sum(t_hash) / max(1, blocks)
    out["full_match_ns_per_block"] = sum(t_match) / max(1, blocks)
    return out


def cache_evictor(kib: int) -> Callable[[], object] | None:
    """A call that reads `kib` KiB (pushing the last decision's data and code out of the
    core's caches), or None for 0."""
    if kib <= 0:
        return None
    import numpy as np

    junk = np.ones(kib * 1024, dtype=np.uint8)
    return junk.sum


def native_hashing() -> bool:
    """Whether the C block hashing (pdserve/_blockhash.c) was built here."""
    from router import kv_index
    return kv_index._native_match is not None


def profile_place(reqs: list[array[int]], decoders: list[WorkerInfo],
                  prefills: list[WorkerInfo], index: KVIndex, placed: dict[str, int],
                  policy: RouterPolicy, top: int = 12) -> list[dict[str, Any]]:
    table = DecodeTable()
    prof = cProfile.Profile()
    prof.enable()
    for arr in reqs:
        place(arr.tolist(), LatencyClass.STANDARD, decoders, prefills, index, placed, policy,
              table=table)
    prof.disable()
    stats = pstats.Stats(prof).get_stats_profile()
    total = stats.total_tt or 1.0
    rows = sorted(stats.func_profiles.items(), key=lambda kv: -kv[1].tottime)[:top]
    return [{"function": f"{Path(fp.file_name).name}:{fp.line_number}({name})",
             "ncalls": fp.ncalls, "tottime_share": round(fp.tottime / total, 3),
             "tottime_us_per_request": round(fp.tottime / len(reqs) * 1e6, 1),
             "cumtime_us_per_request": round(fp.cumtime / len(reqs) * 1e6, 1)}
            for name, fp in rows]


def by_length(reqs: list[array[int]], lat: Sequence[int]) -> list[dict[str, Any]]:
    out = []
    for lo, hi in ((0, 1000), (1000, 2000), (2000, 3000), (3000, 10**9)):
        xs = [t for ids, t in zip(reqs, lat, strict=True) if lo <= len(ids) < hi]
        if xs:
            s = latency_summary(xs)
            out.append({"prompt_tokens": f"{lo}-{hi if hi < 10**9 else ''}",
                        "requests": len(xs), "p50_us": s["p50_us"], "p99_us": s["p99_us"],
                        "decisions_per_s": 1e6 / s["mean_us"]})
    return out


def bench_decisions(cfg: Config, core: int | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rng = random.Random(cfg.seed)
    t0 = time.perf_counter()
    corpus = build_corpus(rng, cfg)
    reqs = decision_requests(rng, corpus, cfg.warmup + cfg.decision_requests)
    warm, timed = reqs[: cfg.warmup], reqs[cfg.warmup :]
    print(f"[1] corpus: {len(corpus.conversations)} conversations, {corpus.distinct_blocks} "
          f"distinct blocks ({time.perf_counter() - t0:.1f} s); {len(timed)} timed requests, "
          f"mean {sum(map(len, timed)) / len(timed):.0f} tokens", flush=True)
    # Threshold placement by default, as the records of this harness before stop 78 measured
    # it (cost is the router's default: --placement cost).
    policy = RouterPolicy(placement=cfg.placement)
    evict = cache_evictor(cfg.cold_kib)
    results: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    split: dict[str, Any] = {}
    profiles: dict[str, Any] = {}
    setups = []
    for n in cfg.worker_counts:
        held = assign_blocks(random.Random(cfg.seed * 1000 + n), corpus, n)
        index, mem = build_index(held, worker_ids(n))
        del held
        memory.append(mem)
        print(f"[2] N={n:>3}: index {index.num_blocks} blocks / {index.num_entries} entries, "
              f"{mem['tracemalloc_bytes'] / 2**20:.0f} MiB", flush=True)
        setups.append((n, index, *fleet(random.Random(cfg.seed + n), n)))
    # Every N's index stays built; the timed passes go round the Ns, so a slow spell of the
    # machine lands on all of them rather than on one.
    rounds: dict[int, list[tuple[float, list[int], list[int], dict[str, float], list[int]]]] = {
        n: [] for n in cfg.worker_counts}
    original = os.sched_getaffinity(0)
    try:
        if core is not None:
            os.sched_setaffinity(0, {core})
        gc.collect()
        tables = {n: DecodeTable() for n in cfg.worker_counts}
        for n, index, decoders, prefills, placed in setups:
            time_place(warm, decoders, prefills, index, placed, policy, tables[n])
        for r in range(cfg.rounds):
            for n, index, decoders, prefills, placed in setups:
                with Interference(core) as itf:
                    lat, cpu, cached = time_place(timed, decoders, prefills, index, placed,
                                                  policy, tables[n], seed=cfg.seed * 100 + r,
                                                  evict=evict)
                rounds[n].append((sum(lat) / len(lat), lat, cached, itf.result, cpu))
        for n, index, decoders, prefills, placed in setups:
            ordered = sorted(rounds[n], key=lambda r: r[0])
            _, lat, cached, itf_result, cpu = ordered[len(ordered) // 2]  # the median round
            if n == cfg.split_workers:
                split = time_split(timed, lat, index)
                split["by_prompt_length"] = by_length(timed, lat)
            if n in (cfg.split_workers, max(cfg.worker_counts)):
                profiles[str(n)] = profile_place(timed[: cfg.profile_requests], decoders,
                                                 prefills, index, placed, policy)
            s = latency_summary(lat)
            dps = 1e6 / s["mean_us"]
            results.append({
                "workers": n, "index_blocks": index.num_blocks,
                "index_entries": index.num_entries, "requests": len(lat),
                "decisions_per_s": dps, **s,
                # CPU time of place() on this thread: unaffected by other processes taking
                # the pinned core (see machine_during_median_round); a lower bound on latency.
                "decisions_per_cpu_s": 1e9 * len(cpu) / sum(cpu),
                "cpu_p50_us": percentile(sorted(cpu), 50) / 1e3,
                "cpu_p99_us": percentile(sorted(cpu), 99) / 1e3,
                "rounds_decisions_per_s": [round(1e9 / r[0]) for r in rounds[n]],
                "machine_during_median_round": itf_result,
                "mean_prompt_tokens": sum(map(len, timed)) / len(timed),
                "requests_with_cache_hit": sum(1 for c in cached if c) / len(cached),
                "mean_cached_fraction": sum(cached) / sum(map(len, timed)),
                "meets": {"decisions_per_s": dps >= TARGET_DECISIONS_PER_S,
                          "p50": s["p50_us"] <= TARGET_P50_MS * 1e3,
                          "p99": s["p99_us"] <= TARGET_P99_MS * 1e3}})
            print(f"[1] N={n:>3}: {dps:8.0f} decisions/s  p50 {s['p50_us']:7.1f} us  "
                  f"p99 {s['p99_us']:7.1f} us  (rounds: "
                  f"{', '.join(str(x) for x in results[-1]['rounds_decisions_per_s'])}/s); "
                  f"CPU: {results[-1]['decisions_per_cpu_s']:.0f}/s, p50 "
                  f"{results[-1]['cpu_p50_us']:.1f} us; core busy with others "
                  f"{itf_result.get('others_busy_share', float('nan')):.0%}", flush=True)
    finally:
        os.sched_setaffinity(0, original)
    del setups
    return {
        "pinned_core": core,
        "gc_enabled": gc.isenabled(),
        "policy": asdict(policy),
        "block_size": BLOCK_SIZE,
        "model_id": MODEL_ID,
        "corpus": {"conversations": len(corpus.conversations),
                   "system_prompts": len(corpus.systems),
                   "distinct_blocks": corpus.distinct_blocks},
        "targets": {"decisions_per_s": TARGET_DECISIONS_PER_S, "p50_ms": TARGET_P50_MS,
                    "p99_ms": TARGET_P99_MS, "at_workers": [64, 256]},
        "results": results,
        "split": {"workers": cfg.split_workers, **split},
        "profile_top_tottime": profiles,
    }, memory


# --------------------------------------------------------------------------- 3


class SimWorker:
    """A decode worker's prefix cache: a real BlockManager serving whole requests (prompt,
    then the reply's slots, full blocks registered), freed when they finish."""

    def __init__(self, worker_id: str, num_blocks: int):
        self.worker_id = worker_id
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, hash_extra=EXTRA, record_events=True)
        self.live: dict[str, list[int]] = {}  # request id -> block table, oldest first
        self.forced = 0  # requests finished early to make room

    def serve(self, rid: str, req: ChatRequest) -> None:
        bm, tokens = self.bm, req.conv.tokens
        prompt_len, full_len = req.prompt_len, req.full_len
        need = bm.blocks_needed(full_len)
        if need > bm.num_blocks:
            raise RuntimeError(f"a {full_len}-token request cannot fit {bm.num_blocks} blocks")
        while bm.num_free_blocks < need and self.live:
            self.finish(next(iter(self.live)))
            self.forced += 1
        alloc = bm.allocate_prompt(rid, tokens[:prompt_len], prompt_len,
                                   max_cached=prompt_len - 1, block_hashes=req.prompt_hashes())
        if alloc is None or not bm.append_slots(alloc[0], full_len):
            raise RuntimeError("allocation failed with enough free blocks")
        bm.register_full_blocks(rid, tokens[:full_len], full_len, alloc[0])
        self.live[rid] = alloc[0]

    def finish(self, rid: str) -> None:
        table = self.live.pop(rid, None)
        if table is not None:
            self.bm.free(rid, table)


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, separators=(",", ":")), flush=True)


async def publisher_main(args: argparse.Namespace) -> int:
    """`--publisher`: the workers' side of section 3. JSON lines on stdout."""
    rng = random.Random(args.seed)
    ids = worker_ids(args.workers)
    reg = WorkerRegistry.from_url(args.redis_url, namespace=args.namespace)
    try:
        streams = KVEventStreams(reg, maxlen=args.maxlen)
        workers = {w: SimWorker(w, args.blocks_per_worker) for w in ids}
        seq = dict.fromkeys(ids, 0)

        async def send(worker_id: str, batches: list[KVEventBatch]) -> None:
            for b in batches:
                await streams.publish(worker_id, b)
            seq[worker_id] = batches[-1].seq

        for w in ids:
            await streams.reset(w)
            await send(w, snapshot_batches([], first_seq=1))
        emit({"event": "ready"})
        t0, c0 = time.perf_counter(), time.process_time()
        systems = make_systems(rng, 32, 300, 800)
        stream = chat_stream(rng, systems, ChatSpec(), args.open_conversations)
        home: dict[int, str] = {}
        inflight: deque[tuple[str, str]] = deque()
        ops = batches = requests = removed = 0
        while ops < args.target_ops:
            req = next(stream)
            w = home.setdefault(req.conv.cid, rng.choice(ids))
            rid = f"r{requests}"
            requests += 1
            workers[w].serve(rid, req)
            inflight.append((w, rid))
            while len(inflight) > args.inflight:
                fw, frid = inflight.popleft()
                workers[fw].finish(frid)
            events = workers[w].bm.drain_events()
            removed += sum(1 for op, _ in events if op is KVOp.REMOVED)
            for i in range(0, len(events), PUBLISH_CHUNK):
                chunk = tuple(events[i : i + PUBLISH_CHUNK])
                await send(w, [KVEventBatch(1, seq[w] + 1, BLOCK_SIZE, chunk)])
                ops += len(chunk)
                batches += 1
            if req.turn + 1 == len(req.conv.turns):
                home.pop(req.conv.cid, None)
        for fw, frid in inflight:
            workers[fw].finish(frid)
        emit({"event": "done", "ops": ops, "removed_ops": removed, "batches": batches,
              "requests": requests,
              "publish_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
              "seq": seq, "forced_finishes": sum(x.forced for x in workers.values()),
              "cached_blocks": {w: len(x.bm.cached_hashes()) for w, x in workers.items()},
              "digests": {w: digest(x.bm.cached_hashes()) for w, x in workers.items()}})
        return 0
    finally:
        await reg.close()


def ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    for _ in range(5):  # another process may take the port between probe and bind
        port = free_port()
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no"], cwd=workdir,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            if ping(port):
                return proc, port
            time.sleep(0.05)
        stop_process(proc)
    raise RuntimeError("could not start redis-server")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def open_log(path: Path) -> Any:
    return open(path, "wb")


async def read_json_line(stream: asyncio.StreamReader, within_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("publisher said nothing in time")
        line = await asyncio.wait_for(stream.readline(), left)
        if not line:
            raise RuntimeError("publisher exited early")
        with contextlib.suppress(ValueError):
            obj = json.loads(line)
            if isinstance(obj, dict):
                return obj


def verify(index: KVIndex, ids: Sequence[str], digests: dict[str, str]) -> list[str]:
    """Workers whose blocks in the index differ from the publisher's real cache."""
    return [w for w in ids if digest(list(index.held(w))) != digests.get(w)]


async def follow(streams: KVEventStreams, ids: list[str], until_ops: asyncio.Future[int] | int,
                 deadline: float, core: int | None
                 ) -> tuple[KVIndex, KVIndexFollower, dict[str, Any]]:
    """Fold entries into a fresh index until it holds `until_ops` ops (a number, or one the
    publisher reports when it is done); wall and CPU time from the first poll."""
    index = KVIndex()
    follower = KVIndexFollower(streams, index, lambda: ids)
    polls = entries = read_errors = 0
    t0, c0 = time.perf_counter(), time.process_time()
    t_last, c_last = t0, c0  # when the last entry was folded in (not the idle wait after)
    with Interference(core) as itf:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"follower stuck at {index.ops_applied} ops")
            try:
                got = await follower.poll()
            except ControlPlaneError:  # as the router's follower: a slow Redis, read again
                read_errors += 1
                continue
            if got:
                entries += got
                t_last, c_last = time.perf_counter(), time.process_time()
            polls += 1
            target = until_ops if isinstance(until_ops, int) else (
                until_ops.result() if until_ops.done() else None)
            if target is not None and index.ops_applied >= target:
                break
    return index, follower, {"wall_s": t_last - t0, "cpu_s": c_last - c0, "polls": polls,
                             "read_errors": read_errors,
                             "entries": entries, "follower_core_during": itf.result}


async def bench_events(cfg: Config, follower_core: int | None, other_core: int | None,
                       ) -> dict[str, Any]:
    ids = worker_ids(cfg.events_workers)
    namespace = f"rscale{os.getpid()}"
    redis_proc: subprocess.Popen[bytes] | None = None
    pub: asyncio.subprocess.Process | None = None
    reg: WorkerRegistry | None = None
    original = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory(prefix="router_scale_") as tmp:
        try:
            redis_proc, port = start_redis(Path(tmp))
            url = f"redis://127.0.0.1:{port}/0"
            stderr_log = open_log(Path(tmp) / "publisher.stderr")
            try:
                pub = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "bench.router_scale", "--publisher",
                    "--redis-url", url, "--namespace", namespace,
                    "--workers", str(cfg.events_workers),
                    "--target-ops", str(cfg.events_ops), "--seed", str(cfg.seed + 7),
                    "--blocks-per-worker", str(cfg.events_blocks_per_worker),
                    "--inflight", str(cfg.events_inflight), "--open-conversations", "256",
                    cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=stderr_log)
            finally:
                stderr_log.close()
            if other_core is not None:
                for pid in (pub.pid, redis_proc.pid):
                    os.sched_setaffinity(pid, {other_core})
            if follower_core is not None:
                os.sched_setaffinity(0, {follower_core})
            assert pub.stdout is not None
            stdout = pub.stdout
            ready = await read_json_line(stdout, TIMEOUT_S)
            if ready.get("event") != "ready":
                raise RuntimeError(f"publisher: {ready}")
            reg = WorkerRegistry.from_url(url, namespace=namespace)
            streams = KVEventStreams(reg)
            loop = asyncio.get_running_loop()
            done_info: asyncio.Future[dict[str, Any]] = loop.create_future()
            total_ops: asyncio.Future[int] = loop.create_future()

            async def wait_done() -> None:
                try:
                    info = await read_json_line(stdout, TIMEOUT_S * 3)
                    done_info.set_result(info)
                    total_ops.set_result(int(info["ops"]))
                except BaseException as exc:
                    if not done_info.done():
                        done_info.set_exception(exc)
                        total_ops.set_exception(exc)
                    raise

            reader = asyncio.create_task(wait_done())
            try:
                live_index, _, live = await follow(
                    streams, ids, total_ops, time.monotonic() + TIMEOUT_S * 3, follower_core)
                info = await asyncio.wait_for(done_info, TIMEOUT_S)
            finally:
                if not reader.done():
                    reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
            await asyncio.wait_for(pub.wait(), TIMEOUT_S)
            # The same streams again, from the start, all entries there: capacity.
            gc.collect()
            drain_index, drain_follower, drain = await follow(
                streams, ids, int(info["ops"]), time.monotonic() + TIMEOUT_S, follower_core)
            digests = info["digests"]
            live_bad = verify(live_index, ids, digests)
            drain_bad = verify(drain_index, ids, digests)
            ops = int(info["ops"])
            return {
                "workers": cfg.events_workers,
                "blocks_per_worker": cfg.events_blocks_per_worker,
                "follower": {"count": drain_follower.count, "block_ms": drain_follower.block_ms,
                             "core": follower_core},
                "publisher_and_redis_core": other_core,
                "ops": ops,
                "removed_ops": info["removed_ops"],
                "batches": info["batches"],
                "mean_ops_per_batch": ops / max(1, info["batches"]),
                "requests": info["requests"],
                "publisher": {"wall_s": info["publish_s"], "cpu_s": info["cpu_s"],
                              "ops_per_s": ops / info["publish_s"],
                              "forced_finishes": info["forced_finishes"]},
                "live": {**live, "ops_per_s": ops / live["wall_s"],
                         "ops_per_cpu_s": ops / max(live["cpu_s"], 1e-9),
                         "resyncs": live_index.resyncs, "mismatched_workers": live_bad},
                "drain": {**drain, "ops_per_s": ops / drain["wall_s"],
                          "ops_per_cpu_s": ops / max(drain["cpu_s"], 1e-9),
                          "resyncs": drain_index.resyncs, "mismatched_workers": drain_bad},
                "index_blocks": drain_index.num_blocks,
                "index_entries": drain_index.num_entries,
                "cached_blocks_total": sum(info["cached_blocks"].values()),
                "index_equals_caches": not live_bad and not drain_bad
                and live_index.resyncs == 0 and drain_index.resyncs == 0,
            }
        except (RuntimeError, TimeoutError, OSError) as exc:
            log = Path(tmp) / "publisher.stderr"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"section 3 failed: {exc}\npublisher stderr:\n{tail}") from exc
        finally:
            os.sched_setaffinity(0, original)
            if reg is not None:
                await reg.close()
            if pub is not None and pub.returncode is None:
                pub.kill()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(pub.wait(), 10)
            if redis_proc is not None:
                stop_process(redis_proc)


# --------------------------------------------------------------------------- 4


@dataclass
class Sim:
    """64 decode workers' caches and the router's view of them, for one policy run."""

    n: int
    capacity: int
    workers: list[SimWorker] = field(init=False)
    infos: list[WorkerInfo] = field(init=False)
    index: KVIndex = field(init=False)
    seq: list[int] = field(init=False)

    def __post_init__(self) -> None:
        ids = worker_ids(self.n)
        self.workers = [SimWorker(w, self.capacity) for w in ids]
        now = time.time()
        self.infos = [WorkerInfo(worker_id=w, role="decode",
                                 grpc_address=f"127.0.0.1:{20000 + i}", model_id=MODEL_ID,
                                 epoch=1, started_at=now,
                                 load=WorkerLoad(free_blocks=self.capacity,
                                                 total_blocks=self.capacity))
                      for i, w in enumerate(ids)]
        self.index = KVIndex()
        self.seq = [1] * self.n
        for w in ids:
            self.index.apply(w, KVEventBatch(1, 1, BLOCK_SIZE, (), snapshot=True))

    def refresh(self, w: int) -> None:
        x = self.workers[w]
        self.infos[w] = replace(self.infos[w], load=WorkerLoad(
            running=len(x.live), free_blocks=x.bm.num_free_blocks, total_blocks=self.capacity))

    def running(self) -> dict[str, int]:
        return {x.worker_id: len(x.live) for x in self.workers}


def run_policy(name: str, reqs: Sequence[ChatRequest], cfg: Config, inflight: int, lag: int,
               seed: int) -> dict[str, Any]:
    """One policy over the request stream; a request finishes `inflight` decisions after it
    was placed, its worker's events reach the index `lag` decisions after."""
    sim = Sim(cfg.hit_workers, cfg.hit_blocks_per_worker)
    rng = random.Random(seed)
    # "index": the decode worker by load + cache affinity, as the records measured it
    policy = RouterPolicy(placement="threshold")
    prefills = [WorkerInfo(worker_id="prefill-000", role="prefill",
                           grpc_address="127.0.0.1:30000", model_id=MODEL_ID, epoch=1,
                           started_at=time.time())]
    finishing: deque[tuple[int, int, str]] = deque()  # (due step, worker, request id)
    pending: deque[tuple[int, int, KVEventBatch]] = deque()  # (due step, worker, batch)
    hit = total = 0
    resyncs = 0
    t0 = time.perf_counter()
    for step, req in enumerate(reqs):
        while finishing and finishing[0][0] <= step:
            _, w, rid = finishing.popleft()
            sim.workers[w].finish(rid)
            sim.refresh(w)
        while pending and pending[0][0] <= step:
            _, w, b = pending.popleft()
            if sim.index.apply(sim.workers[w].worker_id, b) is not Applied.OK:
                resyncs += 1
        prompt_len = req.prompt_len
        ph = req.prompt_hashes()
        if name == "index":
            ids = req.conv.tokens[:prompt_len].tolist()
            p = place(ids, LatencyClass.STANDARD, sim.infos, prefills, sim.index,
                      sim.running(), policy, tiebreak=step)  # the router advances it too
            w = int(p.decode.worker_id.rsplit("-", 1)[1])
        elif name == "oracle":
            prompt = req.conv.tokens[:prompt_len]
            cap = cfg.hit_blocks_per_worker
            cands = [DecodeCandidate(x.worker_id, x.bm.num_cached_tokens(prompt, ph),
                                     len(x.live), 0.0, x.bm.num_free_blocks, cap)
                     for x in sim.workers]
            best = choose_decode(cands, prompt_len, policy, tiebreak=step)
            w = int(best.worker_id.rsplit("-", 1)[1])
        elif name == "load_only":
            least = min(len(x.live) for x in sim.workers)
            w = rng.choice([i for i, x in enumerate(sim.workers) if len(x.live) == least])
        elif name == "round_robin":
            w = step % sim.n
        elif name == "random":
            w = rng.randrange(sim.n)
        else:
            raise ValueError(name)
        x = sim.workers[w]
        hit += x.bm.num_cached_tokens(req.conv.tokens[:prompt_len], ph)
        total += prompt_len
        rid = f"r{step}"
        x.serve(rid, req)
        finishing.append((step + inflight, w, rid))
        events = x.bm.drain_events()
        if events:
            sim.seq[w] += 1
            pending.append((step + lag, w, KVEventBatch(1, sim.seq[w], BLOCK_SIZE,
                                                        tuple(events))))
        sim.refresh(w)
    wall = time.perf_counter() - t0
    for _, w, b in pending:
        if sim.index.apply(sim.workers[w].worker_id, b) is not Applied.OK:
            resyncs += 1
    equal = name != "index" or (resyncs == 0 and all(
        sim.index.held(x.worker_id) == set(x.bm.cached_hashes()) for x in sim.workers))
    used = sum(1 for x in sim.workers if x.bm.prefix_queries)
    evicted = sum(x.bm.event_count for x in sim.workers)  # stored + removed
    return {"hit_rate": hit / total, "prompt_tokens": total, "cached_tokens": hit,
            "workers_used": used, "forced_finishes": sum(x.forced for x in sim.workers),
            "cache_events": evicted, "wall_s": round(wall, 2),
            **({"index_equals_caches": equal, "resyncs": resyncs} if name == "index" else {})}


POLICIES = ("index", "oracle", "load_only", "round_robin", "random")


def bench_hit_rate(cfg: Config) -> dict[str, Any]:
    rng = random.Random(cfg.seed + 99)
    systems = make_systems(rng, cfg.hit_systems, 300, 800)
    reqs = list(itertools.islice(chat_stream(rng, systems, ChatSpec(),
                                             cfg.hit_open_conversations), cfg.hit_requests))
    out: dict[str, Any] = {
        "workers": cfg.hit_workers, "blocks_per_worker": cfg.hit_blocks_per_worker,
        "requests": len(reqs), "system_prompts": cfg.hit_systems,
        "open_conversations": cfg.hit_open_conversations,
        "mean_prompt_tokens": sum(r.prompt_len for r in reqs) / len(reqs),
        "K": cfg.hit_lag, "runs": {}}
    pairs = [(cfg.hit_lag, cfg.hit_lag), *cfg.hit_extra]
    full: dict[int, dict[str, Any]] = {}  # in flight -> every policy's result (lag = K)
    for inflight, lag in pairs:
        names = POLICIES if inflight not in full else ("index",)
        runs: dict[str, Any] = {}
        for name in names:
            runs[name] = run_policy(name, reqs, cfg, inflight, lag, cfg.seed + 5)
            print(f"[4] in flight {inflight:<3} lag {lag:<3} {name:<12} hit rate "
                  f"{runs[name]['hit_rate']:.3f} on {runs[name]['workers_used']} workers "
                  f"({runs[name]['wall_s']} s)", flush=True)
        base = full.setdefault(inflight, runs)
        o, lo = base["oracle"]["hit_rate"], base["load_only"]["hit_rate"]
        i = runs["index"]["hit_rate"]
        gap = (o - i) / o if o else 0.0
        out["runs"][f"inflight={inflight},lag={lag}"] = {
            "inflight": inflight, "event_lag": lag, "policies": runs,
            "index_gap_to_oracle_points": o - i, "index_gap_to_oracle_relative": gap,
            "meets": {"within_3pct_of_oracle": gap <= TARGET_ORACLE_GAP,
                      "above_load_only": i > lo}}
    out["index_equals_caches"] = all(r["policies"]["index"]["index_equals_caches"]
                                     for r in out["runs"].values())
    return out


# --------------------------------------------------------------------------- report


def print_report(rec: dict[str, Any]) -> None:
    m = rec["machine"]
    print(f"\nrouter_scale  {m['date']}  {m['cpu_model']}  python {m['python']}  "
          f"commit {(m['git_commit'] or '?')[:12]}{' (dirty)' if m['git_dirty'] else ''}")
    d = rec["decision"]
    print(f"\n1. place() on one core (core {d['pinned_core']}), index "
          f"~{d['corpus']['distinct_blocks']} blocks; targets >= "
          f"{TARGET_DECISIONS_PER_S:.0f}/s, p50 <= {TARGET_P50_MS} ms, "
          f"p99 <= {TARGET_P99_MS} ms")
    print(f"{'workers':>8} {'blocks':>9} {'entries':>9} {'dec/s':>8} {'p50 us':>8} "
          f"{'p99 us':>8} {'max us':>8}  meets(dps,p50,p99)")
    for r in d["results"]:
        mt = r["meets"]
        print(f"{r['workers']:>8} {r['index_blocks']:>9} {r['index_entries']:>9} "
              f"{r['decisions_per_s']:>8.0f} {r['p50_us']:>8.1f} {r['p99_us']:>8.1f} "
              f"{r['max_us']:>8.0f}  {mt['decisions_per_s']},{mt['p50']},{mt['p99']}")
    s = d["split"]
    if "place" in s:
        parts = ", ".join(f"{k} {s[k]['mean_us']:.1f} us ({s[k]['share_of_place']:.0%})"
                          for k in ("match_prompt", "rest"))
        print(f"   split at {s['workers']} workers (mean {s['mean_prompt_blocks']:.0f} blocks/"
              f"prompt, native hashing {s['native_hashing']}): {parts}; for reference, "
              f"hashing every block {s['full_hash_ns_per_block']:.0f} ns/block, the walk over "
              f"them {s['full_match_ns_per_block']:.0f} ns/block")
        for b in s["by_prompt_length"]:
            print(f"     prompts {b['prompt_tokens']:>10} tokens: {b['decisions_per_s']:>7.0f}/s"
                  f"  p50 {b['p50_us']:.0f} us  p99 {b['p99_us']:.0f} us")
    print("\n2. index memory")
    print(f"{'workers':>8} {'blocks':>9} {'entries':>9} {'memory_bytes':>13} {'B/block':>8} "
          f"{'tracemalloc':>12} {'B/block':>8}")
    for r in rec["memory"]:
        print(f"{r['workers']:>8} {r['index_blocks']:>9} {r['index_entries']:>9} "
              f"{r['memory_bytes']:>13} {r['memory_bytes_per_block']:>8.0f} "
              f"{r['tracemalloc_bytes']:>12} {r['tracemalloc_bytes_per_block']:>8.0f}")
    e = rec["events"]
    print(f"\n3. KV events through Redis: {e['workers']} publishers, {e['ops']} ops in "
          f"{e['batches']} batches ({e['mean_ops_per_batch']:.0f} ops/batch)")
    print(f"   publisher           {e['publisher']['ops_per_s']:>10.0f} ops/s")
    for mode in ("live", "drain"):
        x = e[mode]
        print(f"   follower {mode:<10} {x['ops_per_s']:>10.0f} ops/s wall, "
              f"{x['ops_per_cpu_s']:>10.0f} ops per follower CPU s, resyncs {x['resyncs']}, "
              f"mismatched {len(x['mismatched_workers'])}")
    print(f"   index equals the real caches: {e['index_equals_caches']}")
    h = rec["hit_rate"]
    print(f"\n4. prefix-hit rate, {h['workers']} workers x {h['blocks_per_worker']} blocks, "
          f"{h['requests']} requests (mean prompt {h['mean_prompt_tokens']:.0f} tokens)")
    for k, run in h["runs"].items():
        row = "  ".join(f"{p} {x['hit_rate']:.3f} ({x['workers_used']}w)"
                        for p, x in run["policies"].items())
        print(f"   {k}: {row}")
        print(f"         index gap to oracle {run['index_gap_to_oracle_points'] * 100:+.2f} "
              f"points ({run['index_gap_to_oracle_relative']:+.1%} relative); meets "
              f"{run['meets']}")
    print(f"   index equals the real caches: {h['index_equals_caches']}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.router_scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes, under a minute")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    ap.add_argument("--lag", type=int, default=None,
                    help="section 4: decisions a request stays in flight and its events' "
                    "lag (K, default 4)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: 1,3,4")
    ap.add_argument("--placement", choices=("threshold", "cost"), default=None,
                    help="section 1's placement policy (default threshold, as the records "
                    "before stop 78 were made; the router's own default is cost)")
    ap.add_argument("--cold-kib", type=int, default=None,
                    help="section 1: KiB read between two timed decisions, untimed, so each "
                    "runs with its caches cold as in the router (default 0: warm)")
    pub = ap.add_argument_group("publisher mode (section 3's child process)")
    pub.add_argument("--publisher", action="store_true", help=argparse.SUPPRESS)
    pub.add_argument("--redis-url", default="")
    pub.add_argument("--namespace", default="rscale")
    pub.add_argument("--workers", type=int, default=64)
    pub.add_argument("--target-ops", type=int, default=500_000)
    pub.add_argument("--blocks-per-worker", type=int, default=4096)
    pub.add_argument("--inflight", type=int, default=256)
    pub.add_argument("--open-conversations", type=int, default=256)
    pub.add_argument("--maxlen", type=int, default=1024)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.publisher:
        return asyncio.run(publisher_main(args))
    cfg = QUICK if args.quick else Config()
    cfg = replace(cfg, seed=args.seed)
    if args.placement is not None:
        cfg = replace(cfg, placement=args.placement)
    if args.cold_kib is not None:
        cfg = replace(cfg, cold_kib=args.cold_kib)
    if args.lag is not None:
        cfg = replace(cfg, hit_lag=args.lag)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    cores = sorted(os.sched_getaffinity(0))
    follower_core = cores[-1] if cores else None
    other_core = cores[0] if len(cores) > 1 else None
    rec: dict[str, Any] = {"benchmark": "bench.router_scale", "quick": args.quick,
                           "machine": machine(), "config": asdict(cfg)}
    t0 = time.perf_counter()
    rec["machine"]["loadavg_start"] = loadavg()
    if "1" not in skip:
        rec["decision"], rec["memory"] = bench_decisions(cfg, follower_core)
        rec["decision"]["loadavg_after"] = loadavg()
    if "3" not in skip:
        rec["events"] = asyncio.run(bench_events(cfg, follower_core, other_core))
        e = rec["events"]
        e["loadavg_after"] = loadavg()
        print(f"[3] {e['ops']} ops: live {e['live']['ops_per_s']:.0f} ops/s, drain "
              f"{e['drain']['ops_per_s']:.0f} ops/s, equal {e['index_equals_caches']}",
              flush=True)
    if "4" not in skip:
        rec["hit_rate"] = bench_hit_rate(cfg)
    rec["total_s"] = round(time.perf_counter() - t0, 1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rec, indent=2) + "\n")
    if not skip:
        print_report(rec)
    print(f"\ntotal {rec['total_s']} s" + (f"; wrote {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
