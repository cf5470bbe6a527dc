"""Worker leases, epochs and KV memory descriptors in the control plane's Redis
(`pdserve.control.store` has the key layout, the bounded commands and the record signing).

A lease is fenced by epoch: once a newer epoch was handed out for a worker id, heartbeats of
older incarnations are refused (checked atomically in Lua) and they learn they lost their
lease (`WorkerRegistry.lease_lost`), so a zombie never overwrites its successor's record.
A decode worker's descriptor lives as long as its lease: each heartbeat refreshes it (and
writes it again if Redis lost it), deregistering deletes it.

The Lua scripts build keys from a prefix, so they assume a single (non-cluster) Redis.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping

import redis.asyncio as aioredis
import structlog

from pdserve.aio import stop_task
from pdserve.control.descriptors import KVDescriptor
from pdserve.control.load import WorkerLoad
from pdserve.control.signing import RecordSigner
from pdserve.control.store import ControlStore, live_records_lua
from pdserve.control.workers import Role, WorkerInfo
from pdserve.errors import ControlPlaneError, ErrorCode
from pdserve.kv_layout import KVLayout

__all__ = ["LoadFn", "WorkerInfo", "WorkerRegistry"]

log = structlog.get_logger(__name__)

LoadFn = Callable[[], WorkerLoad | Mapping[str, float]]


# KEYS[1] worker key, KEYS[2] workers set, KEYS[3] epoch counter, KEYS[4..] descriptor keys.
# ARGV: record json, ttl ms, epoch, worker id, then one descriptor json per descriptor key.
# Returns 0 when a newer epoch exists (handed out by the counter, or in a live record): this
# incarnation must stop; 1 when the lease was refreshed; 2 when it had to be re-created (the
# record was gone: a restarted, empty Redis, or a lease that lapsed while Redis was away).
# A counter that is missing or behind our epoch (an empty Redis lost it) is raised to our
# epoch, so the next `next_epoch` for this worker id is still strictly newer than ours, and
# missing descriptors are written again from what we published.
_HEARTBEAT_LUA = """
local epoch = tonumber(ARGV[3])
local newest = tonumber(redis.call('GET', KEYS[3]))
if newest ~= nil and newest > epoch then
  return 0
end
if newest == nil or newest < epoch then
  redis.call('SET', KEYS[3], ARGV[3])
end
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, rec = pcall(cjson.decode, cur)
  if ok and type(rec) == 'table' and tonumber(rec['epoch']) ~= nil
     and tonumber(rec['epoch']) > epoch then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[4])
for i = 4, #KEYS do
  if redis.call('PEXPIRE', KEYS[i], ARGV[2]) == 0 and ARGV[i + 1] then
    redis.call('SET', KEYS[i], ARGV[i + 1], 'PX', ARGV[2])
  end
end
if cur then
  return 1
end
return 2
"""

# KEYS[1] worker key, KEYS[2] workers set, KEYS[3..] descriptor keys to delete.
# ARGV: epoch, worker id.  The worker record is removed only if it is still ours.
_DEREGISTER_LUA = """
for i = 3, #KEYS do
  redis.call('DEL', KEYS[i])
end
local cur = redis.call('GET', KEYS[1])
if not cur then
  return 0
end
local ok, rec = pcall(cjson.decode, cur)
if ok and type(rec) == 'table' and tonumber(rec['epoch']) == tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
  return 1
end
return 0
"""

# `list_workers` decodes (and, signed, verifies) the records it reads in slices of this many,
# yielding to the event loop between them: the router shares its loop with its requests.
LIST_YIELD_EVERY = 16

# KEYS[1] workers set; ARGV[1] worker key prefix.  Returns live records, prunes dead ids.
_LIST_LUA = "local out = {}" + live_records_lua("KEYS[1]", "ARGV[1]") + "return out"


class WorkerRegistry(ControlStore):
    """A worker's lease in the control plane, plus read access for routers.

    One registry holds at most one lease (`register` ... `deregister`). Use it as
    ``async with WorkerRegistry.from_url(url, namespace=...) as reg:``; leaving the block
    stops the heartbeat, deregisters, and closes the Redis client if the registry created it.
    Every Redis call is bounded by `op_timeout_s` and failures surface as ControlPlaneError.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "default",
        op_timeout_s: float = 2.0,
        owns_client: bool = False,
        signer: RecordSigner | None = None,
    ) -> None:
        super().__init__(client, namespace=namespace, op_timeout_s=op_timeout_s,
                         owns_client=owns_client, signer=signer)
        self._heartbeat_lua = client.register_script(_HEARTBEAT_LUA)
        self._deregister_lua = client.register_script(_DEREGISTER_LUA)
        self._list_lua = client.register_script(_LIST_LUA)

        self._info: WorkerInfo | None = None
        self._ttl_ms = 0
        self._load_fn: LoadFn | None = None
        self._cpus_fn: Callable[[], tuple[int, ...]] | None = None
        self._descriptors: dict[str, str] = {}  # id -> JSON, re-written if Redis lost it
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.lease_lost = asyncio.Event()  # set when a newer epoch took over our worker_id

    async def close(self) -> None:
        """Deregister (one bounded attempt: a dead Redis costs at most `op_timeout_s`) and
        close the client. Never raises for an unreachable Redis, never waits on it longer."""
        try:
            if self._info is not None:
                await self.deregister()
        except ControlPlaneError as err:
            log.warning("deregister_failed", error=str(err))
        finally:
            await self._stop_heartbeat()
            await super().close()

    # ------------------------------------------------------------------ lease

    @property
    def info(self) -> WorkerInfo | None:
        """The record this registry keeps alive, with the load of the last heartbeat."""
        return self._info

    async def next_epoch(self, worker_id: str) -> int:
        """A fresh epoch for `worker_id`, strictly greater than any handed out before."""
        return int(await self.call(self._redis.incr(self._epoch_key(worker_id))))

    async def register(
        self,
        info: WorkerInfo,
        ttl_s: float = 10.0,
        *,
        heartbeat_s: float | None = None,
        load_fn: LoadFn | None = None,
        cpus_fn: Callable[[], tuple[int, ...]] | None = None,
    ) -> None:
        """Write the lease and start heartbeating every `heartbeat_s` (default ttl_s / 3).

        `load_fn` is called on every heartbeat; its numbers replace `info.load`. `cpus_fn`
        too (`this_cpus`): a worker pinned after it started (taskset, a cpuset that changed)
        publishes where it computes now, not where it started. Raises ControlPlaneError if
        Redis is unreachable or a newer epoch already owns the worker id.
        """
        if self._info is not None:
            raise RuntimeError(f"already registered as {self._info.worker_id!r}")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        heartbeat_s = ttl_s / 3 if heartbeat_s is None else heartbeat_s
        if not 0 < heartbeat_s < ttl_s:
            raise ValueError(f"heartbeat_s must be in (0, ttl_s={ttl_s}), got {heartbeat_s}")
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._load_fn = load_fn
        self._cpus_fn = cpus_fn
        self.lease_lost.clear()
        if not await self._write_lease(info):
            raise ControlPlaneError(
                f"worker {info.worker_id!r} epoch {info.epoch} is superseded by a newer epoch",
                code=ErrorCode.LEASE_SUPERSEDED,
            )
        self._info = info
        self._heartbeat_task = asyncio.create_task(
            self._heartbeat_loop(heartbeat_s), name=f"heartbeat:{info.worker_id}"
        )
        log.info("worker_registered", worker_id=info.worker_id, role=info.role, epoch=info.epoch)

    async def deregister(self) -> None:
        """Stop heartbeating and delete our record (if still ours) and our descriptors."""
        await self._stop_heartbeat()
        info, self._info = self._info, None
        if info is None:
            return
        desc_keys = [self.descriptor_key(d) for d in self._descriptors]
        self._descriptors.clear()
        keys = [self.worker_key(info.worker_id), self._workers_key, *desc_keys]
        await self.call(self._deregister_lua(keys=keys, args=[info.epoch, info.worker_id]))
        log.info("worker_deregistered", worker_id=info.worker_id, epoch=info.epoch)

    async def heartbeat(self) -> bool:
        """Refresh the lease once now (the background task does this on its own).

        Returns False, and sets `lease_lost`, if a newer epoch owns our worker id.
        """
        if self._info is None:
            raise RuntimeError("not registered")
        info = self._info
        if self._load_fn is not None:
            info = info.with_load(self._load_fn())
        if self._cpus_fn is not None and (cpus := self._cpus_fn()) != info.cpus:
            log.info("worker_cpus_changed", worker_id=info.worker_id, cpus=list(cpus))
            info = dataclasses.replace(info, cpus=cpus)
        if not await self._write_lease(info):
            log.error("lease_superseded", worker_id=info.worker_id, epoch=info.epoch)
            self.lease_lost.set()
            return False
        self._info = info
        return True

    async def _write_lease(self, info: WorkerInfo) -> bool:
        descriptors = dict(self._descriptors)
        keys = [
            self.worker_key(info.worker_id),
            self._workers_key,
            self._epoch_key(info.worker_id),
            *(self.descriptor_key(d) for d in descriptors),
        ]
        args: list[str | int] = [self._encode_worker(info), self._ttl_ms, info.epoch,
                                 info.worker_id, *descriptors.values()]
        result = int(await self.call(self._heartbeat_lua(keys=keys, args=args)))
        if result == 2 and self._info is not None:
            log.warning("lease_recreated", worker_id=info.worker_id, epoch=info.epoch)
        return result != 0

    async def _heartbeat_loop(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                if not await self.heartbeat():
                    return
            except ControlPlaneError as err:
                # Keep trying: the lease lapses on its own if Redis stays away past the TTL.
                log.warning("heartbeat_failed", error=str(err))
            except Exception:
                log.exception("heartbeat_crashed")  # e.g. a load_fn bug; never kill the lease

    async def _stop_heartbeat(self) -> None:
        task, self._heartbeat_task = self._heartbeat_task, None
        await stop_task(task)

    # ------------------------------------------------------------------ queries

    async def list_workers(self, role: Role | None = None) -> list[WorkerInfo]:
        """Workers whose lease is alive now, optionally of one role, sorted by worker_id."""
        raws = await self.call(
            self._list_lua(keys=[self._workers_key], args=[self._prefix + "worker:"])
        )
        workers = []
        listed: dict[str | bytes, tuple[WorkerInfo, float | None]] = {}
        for n, raw in enumerate(raws, 1):
            if n % LIST_YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a router's requests go on between slices
            info = self._decode_worker(raw, listed)
            if info is not None and (role is None or info.role == role):
                workers.append(info)
        self._decoded = listed
        return sorted(workers, key=lambda w: w.worker_id)

    async def get_worker(self, worker_id: str) -> WorkerInfo | None:
        """The live record of `worker_id`; None if there is none, or none we can trust."""
        raw = await self.call(self._redis.get(self.worker_key(worker_id)))
        if raw is None:
            return None
        info = self._decode_worker(raw)
        return info if info is not None and info.worker_id == worker_id else None

    # ------------------------------------------------------------------ descriptors

    async def publish_descriptor(
        self,
        descriptor_id: str,
        layout: KVLayout,
        ucx_address: str,
        worker_id: str,
        epoch: int,
        *,
        ttl_s: float | None = None,
    ) -> KVDescriptor:
        """Publish where our KV pool can be written. Lives as long as our lease.

        The TTL is the lease's (refreshed by each heartbeat) when registered, else `ttl_s`.
        The descriptor is deleted by `deregister`.
        """
        desc = KVDescriptor(descriptor_id, worker_id, epoch, ucx_address, layout)
        if self._info is not None:
            ttl_ms = self._ttl_ms
        elif ttl_s is not None and ttl_s > 0:
            ttl_ms = max(1, round(ttl_s * 1000))
        else:
            raise ValueError("publish_descriptor needs a registered lease or ttl_s > 0")
        raw = self._encode_descriptor(desc)
        await self.call(self._redis.set(self.descriptor_key(descriptor_id), raw, px=ttl_ms))
        self._descriptors[descriptor_id] = raw
        log.info("kv_descriptor_published", descriptor_id=descriptor_id, ucx_address=ucx_address)
        return desc

    async def get_descriptor(self, descriptor_id: str) -> KVDescriptor | None:
        """The live descriptor, or None if it expired, was deleted, never existed, or (with
        a signer) was not written by a member of this cluster."""
        raw = await self.call(self._redis.get(self.descriptor_key(descriptor_id)))
        return None if raw is None else self._decode_descriptor(descriptor_id, raw)

    async def delete_descriptor(self, descriptor_id: str) -> None:
        self._descriptors.pop(descriptor_id, None)
        await self.call(self._redis.delete(self.descriptor_key(descriptor_id)))
