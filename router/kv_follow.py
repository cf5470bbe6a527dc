"""Keeps a router's KVIndex equal to the workers' prefix caches (decode and prefill workers
alike), from their KV event streams (pdserve.control.kv_events): one task, one XREAD over
every followed stream.

A worker that joins is read from the start of its stream (its epoch's opening snapshot, or,
if the stream was trimmed, a gap that asks for a fresh snapshot); one that leaves the
directory is dropped from the index. While Redis is unreachable the index keeps what it
knew, and the batches it missed show up as a gap later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.aio import stop_task
from pdserve.control.kv_events import KVEventStreams
from pdserve.errors import ControlPlaneError
from router.kv_index import Applied, KVIndex

log = structlog.get_logger(__name__)


class KVIndexFollower:
    def __init__(self, streams: KVEventStreams, index: KVIndex,
                 worker_ids: Callable[[], Iterable[str]], *,
                 metrics_registry: CollectorRegistry | None = None, block_ms: int = 500,
                 count: int = 64, resync_retry_s: float = 2.0, yield_every: int = 64,
                 min_interval_s: float = 0.01):
        self.streams = streams
        self.index = index
        self._worker_ids = worker_ids
        self.block_ms = block_ms
        # Workers publish a batch per ~20 ms each: read again at once and a busy cluster's
        # batches come one XREAD (of every followed stream) each. Reads start at most every
        # `min_interval_s`, so one read takes what arrived meanwhile; the index lags by at
        # most that much more.
        self.min_interval_s = min_interval_s
        self.count = count
        self.resync_retry_s = resync_retry_s
        # The follower shares the router's event loop: folding a backlog (a router starting
        # against full streams) yields to it every `yield_every` entries, and one read takes
        # at most `count` entries per stream.
        self.yield_every = yield_every
        self._offsets: dict[str, bytes] = {}
        self._asked: dict[str, float] = {}  # worker id -> when we last asked for a snapshot
        self._since: dict[str, float] = {}  # worker id -> when we started following it
        self._task: asyncio.Task[None] | None = None
        self._malformed_logged: dict[str, float] = {}  # worker id -> when we last said so
        reg = metrics_registry or CollectorRegistry()
        self.ops_total = Counter("pdserve_router_kv_events_ops_total",
                                 "KV cache events (block stored / removed) folded into the "
                                 "router's prefix index", registry=reg)
        self.resyncs_total = Counter("pdserve_router_kv_index_resyncs_total",
                                     "Times the index dropped a worker's view and asked it "
                                     "for a snapshot (a gap in its KV event stream, a "
                                     "malformed entry, too many blocks)", registry=reg)
        Gauge("pdserve_router_kv_index_blocks", "Distinct prefix blocks the router's index "
              "knows a worker (decode or prefill) holds", registry=reg).set_function(
                  lambda: index.num_blocks)
        self.malformed_total = Counter("pdserve_router_kv_events_malformed_total",
                                       "KV event entries refused (malformed, unsigned or "
                                       "mis-signed: written by someone else than the worker)",
                                       registry=reg)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-index-follower")

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    def _follow(self) -> None:
        current = set(self._worker_ids())
        for worker_id in current - self._offsets.keys():
            self._offsets[worker_id] = b"0"
            self._since[worker_id] = time.monotonic()
        for worker_id in self._offsets.keys() - current:
            del self._offsets[worker_id]
            self._asked.pop(worker_id, None)
            self._since.pop(worker_id, None)
            self.index.remove_worker(worker_id)

    async def poll(self) -> int:
        """One read: fold what arrived into the index; returns the entries read."""
        self._follow()
        entries = await self.streams.read(self._offsets, count=self.count,
                                          block_ms=self.block_ms)
        resync: set[str] = set()
        for n, e in enumerate(entries, 1):
            if n % self.yield_every == 0:
                await asyncio.sleep(0)
            if e.worker_id not in self._offsets:
                continue  # left while we read
            self._offsets[e.worker_id] = e.entry_id
            was_synced = self.index.synced(e.worker_id)
            if e.batch is None:
                self.malformed_total.inc()
                now = time.monotonic()  # one line per worker per 30 s: junk cannot flood it
                if now - self._malformed_logged.get(e.worker_id, -1e9) >= 30.0:
                    self._malformed_logged[e.worker_id] = now
                    log.warning("kv_event_malformed", worker_id=e.worker_id, error=e.error)
                result = self.index.invalid(e.worker_id)
            else:
                result = self.index.apply(e.worker_id, e.batch)
                if result is Applied.OK:
                    self.ops_total.inc(len(e.batch.ops))
                    self._asked.pop(e.worker_id, None)
            if result is Applied.RESYNC:
                resync.add(e.worker_id)
                if was_synced:
                    self.resyncs_total.inc()
        now = time.monotonic()
        # Not synced for a while (its stream expired, or our request got lost): ask (again).
        for worker_id in self._offsets:
            since = self._asked.get(worker_id, self._since[worker_id])
            if not self.index.synced(worker_id) and now - since >= self.resync_retry_s:
                resync.add(worker_id)
        for worker_id in resync:
            if now - self._asked.get(worker_id, -1e9) < self.resync_retry_s * 0.5:
                continue
            self._asked[worker_id] = now
            log.info("kv_index_resync", worker_id=worker_id)
            await self.streams.request_snapshot(worker_id)
        return len(entries)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll()
            except ControlPlaneError as exc:
                log.warning("kv_events_read_failed", error=str(exc))
                await asyncio.sleep(1.0)
            if (wait := started + self.min_interval_s - time.monotonic()) > 0:
                await asyncio.sleep(wait)
