"""KV cache events on Redis streams: decode workers publish, routers read.

Keys, under the registry's ``pdserve:{namespace}:``:

- ``kvev:{worker_id}``     stream of `KVEventBatch` entries (pdserve.kv_events), capped at
  about `maxlen` entries (XADD MAXLEN ~) and expiring `ttl_s` after the last write, so a
  worker that is gone leaves nothing behind for long.
- ``kvsnap:{worker_id}``   set by a reader that saw a gap (or joined after the stream was
  trimmed); the worker answers with a snapshot entry and deletes it.

Each worker epoch starts its stream afresh with a snapshot numbered 1. Entries are fixed-width
bytes and integers, parsed strictly; nothing is ever unpickled. With a cluster secret each
entry is signed by its worker (bound to the worker id, pdserve.control.signing); a reader
treats an unsigned or mis-signed entry as malformed (a gap: it asks for a snapshot).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import structlog

from pdserve.aio import AsyncResource, stop_task
from pdserve.control.registry import WorkerRegistry
from pdserve.control.signing import SignatureError
from pdserve.errors import ControlPlaneError
from pdserve.kv_events import KVEventBatch, KVEventError, KVOp

log = structlog.get_logger(__name__)

# One entry holds at most this many ops: a worker splits larger batches, a reader refuses them
# (64K ops is ~1.1 MB, a snapshot of a 64K-block cache).
MAX_OPS_PER_ENTRY = 1 << 16


@dataclass(frozen=True)
class StreamEntry:
    worker_id: str
    entry_id: bytes
    batch: KVEventBatch | None  # None: malformed (the reader treats it as a gap)
    error: str = ""


class KVEventStreams:
    """The KV event keys of one namespace, over a registry's Redis client and its bounds."""

    def __init__(self, registry: WorkerRegistry, *, maxlen: int = 1024, ttl_s: float = 3600.0,
                 snapshot_request_ttl_s: float = 30.0):
        self.registry = registry
        self.maxlen = maxlen
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.snapshot_request_ttl_ms = max(1, round(snapshot_request_ttl_s * 1000))

    def stream_key(self, worker_id: str) -> str:
        return self.registry.key(f"kvev:{worker_id}")

    def _snapshot_key(self, worker_id: str) -> str:
        return self.registry.key(f"kvsnap:{worker_id}")

    # ------------------------------------------------------------------ worker side

    async def reset(self, worker_id: str) -> None:
        """Drop the stream of an earlier incarnation (a new epoch starts from a snapshot)."""
        r = self.registry
        await r.call(r.redis.delete(self.stream_key(worker_id), self._snapshot_key(worker_id)))

    async def publish(self, worker_id: str, batch: KVEventBatch) -> None:
        r = self.registry
        key = self.stream_key(worker_id)
        fields = batch.to_fields()
        if r.signer is not None:
            fields = r.signer.sign_fields("kvev", worker_id, fields)
        async with r.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(key, fields,  # type: ignore[arg-type]
                      maxlen=self.maxlen, approximate=True)
            pipe.pexpire(key, self.ttl_ms)
            await r.call(pipe.execute())

    async def snapshot_requested(self, worker_id: str) -> bool:
        """True once per request a reader made (GETDEL)."""
        r = self.registry
        return await r.call(r.redis.getdel(self._snapshot_key(worker_id))) is not None

    # ------------------------------------------------------------------ reader side

    async def request_snapshot(self, worker_id: str) -> None:
        r = self.registry
        await r.call(r.redis.set(self._snapshot_key(worker_id), b"1",
                                 px=self.snapshot_request_ttl_ms))

    async def read(self, offsets: dict[str, bytes], *, count: int = 512,
                   block_ms: int = 500) -> list[StreamEntry]:
        """Entries after `offsets` (worker id -> last entry id read; b"0" for the start),
        waiting up to `block_ms` for the first; parsed, in stream order per worker."""
        if not offsets:
            await asyncio.sleep(block_ms / 1000)
            return []
        r = self.registry
        keys = {self.stream_key(w): w for w in offsets}
        streams = {k: offsets[w] for k, w in keys.items()}
        reply = await r.call(r.redis.xread(streams, count=count, block=block_ms),  # type: ignore[arg-type]
                             timeout_s=r.op_timeout_s + block_ms / 1000)
        out: list[StreamEntry] = []
        # RESP2 (the registry's client): [[key, [(entry id, {field: value}), ...]], ...]
        for raw_key, entries in cast("list[list[Any]]", reply) or ():
            key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
            worker_id = keys.get(key)
            if worker_id is None:
                continue
            for entry_id, fields in entries:
                try:
                    if r.signer is not None:
                        fields = r.signer.verify_fields("kvev", worker_id, fields)
                    batch = KVEventBatch.from_fields(fields, max_ops=MAX_OPS_PER_ENTRY)
                except (KVEventError, SignatureError) as exc:
                    out.append(StreamEntry(worker_id, entry_id, None, str(exc)))
                    continue
                out.append(StreamEntry(worker_id, entry_id, batch))
        return out


class KVEventSource(Protocol):
    """What the publisher needs of an engine (AsyncEngine has it)."""

    async def take_kv_events(self) -> list[tuple[KVOp, bytes]] | None: ...

    async def kv_snapshot(self) -> list[bytes]: ...


class KVEventPublisher(AsyncResource):
    """A decode worker's side: whenever `changed()` moved (the engine's count of recorded
    cache changes), move the prefix cache's events to the worker's stream, batched at most
    every `interval_s`; answer snapshot requests; after any failure to publish, or an
    overflow of the engine's bounded queue, publish a snapshot so readers resynchronise.
    An idle worker costs one Redis GETDEL per `snapshot_poll_s` and nothing on its engine."""

    def __init__(self, streams: KVEventStreams, source: KVEventSource,
                 changed: Callable[[], object], *, worker_id: str, epoch: int,
                 block_size: int, interval_s: float = 0.02, snapshot_poll_s: float = 0.5,
                 max_ops: int = 4096):
        self.streams = streams
        self.source = source
        self._changed = changed  # a value that differs whenever the engine may have events
        self.worker_id = worker_id
        self.epoch = epoch
        self.block_size = block_size
        self.interval_s = interval_s
        self.snapshot_poll_s = snapshot_poll_s
        self.max_ops = min(max_ops, MAX_OPS_PER_ENTRY)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self.published_batches = 0
        self.published_ops = 0
        self.snapshots = 0

    async def start(self) -> None:
        """Reset the stream and publish the opening snapshot (raises if Redis is down: the
        worker does not start without its control plane), then follow in the background."""
        await self.streams.reset(self.worker_id)
        await self._snapshot()
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.worker_id}")

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)


    async def _publish(self, ops: list[tuple[KVOp, bytes]], *, snapshot: bool) -> None:
        chunks = [ops[i : i + self.max_ops] for i in range(0, len(ops), self.max_ops)] or [[]]
        for i, chunk in enumerate(chunks):
            self._seq += 1
            # Only the first entry of a snapshot replaces what readers knew; the rest add to it.
            batch = KVEventBatch(self.epoch, self._seq, self.block_size, tuple(chunk),
                                 snapshot=snapshot and i == 0)
            await self.streams.publish(self.worker_id, batch)
            self.published_batches += 1
            self.published_ops += len(chunk)

    async def _snapshot(self) -> None:
        hashes = await self.source.kv_snapshot()
        await self._publish([(KVOp.STORED, h) for h in hashes], snapshot=True)
        self.snapshots += 1
        log.info("kv_snapshot_published", worker_id=self.worker_id, epoch=self.epoch,
                 seq=self._seq, blocks=len(hashes))

    async def _run(self) -> None:
        seen: object = None
        need_snapshot = False
        next_poll = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if loop.time() >= next_poll:
                    next_poll = loop.time() + self.snapshot_poll_s
                    if await self.streams.snapshot_requested(self.worker_id):
                        need_snapshot = True
                if need_snapshot:
                    await self._snapshot()
                    need_snapshot = False
                    continue
                now = self._changed()
                if now == seen:
                    continue
                seen = now
                ops = await self.source.take_kv_events()
                if ops is None:  # the engine's queue overflowed: only a snapshot is exact
                    need_snapshot = True
                elif ops:
                    await self._publish(ops, snapshot=False)
            except ControlPlaneError as exc:
                # The batch is lost (readers will see a gap): resynchronise once Redis is back.
                need_snapshot = True
                log.warning("kv_events_publish_failed", worker_id=self.worker_id,
                            error=str(exc))
                await asyncio.sleep(1.0)

