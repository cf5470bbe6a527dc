"""How the control plane talks to Redis: one client, namespaced keys, bounded commands and
signed records. `pdserve.control.registry.WorkerRegistry` (leases, epochs, descriptors) is
built on it; the KV event streams and the worker directory share its client through it.

Key layout, all under ``pdserve:{namespace}:`` so tests and deployments never collide:

- ``worker:{worker_id}``   JSON WorkerInfo, TTL = lease; refreshed by the heartbeat.
- ``workers``              set of worker ids that may hold a lease (pruned lazily).
- ``epoch:{worker_id}``    INCR counter; never expires, so a restart always gets a fresh epoch.
- ``kvdesc:{descriptor_id}`` JSON KVDescriptor, same TTL as the lease that published it.
- ``kvev:{worker_id}``, ``kvsnap:{worker_id}`` a worker's KV event stream and its snapshot
  (pdserve.control.kv_events).

Values are JSON only; nothing is ever pickled. With a cluster secret, every record and
descriptor is signed by its writer and verified by every reader (pdserve.control.signing):
a record someone else wrote into Redis is dropped, never used.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable
from typing import Any, Self, TypeVar

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from pdserve.aio import AsyncResource
from pdserve.control.descriptors import DescriptorFormatError, KVDescriptor
from pdserve.control.signing import RecordSigner, SignatureError
from pdserve.control.workers import WorkerInfo, WorkerInfoError
from pdserve.errors import ControlPlaneError
from pdserve.ratelog import RateLimitedLog

__all__ = ["ControlStore", "live_records_lua"]

log = structlog.get_logger(__name__)

T = TypeVar("T")


def live_records_lua(set_key: str, key_prefix: str, skip: str | None = None) -> str:
    """Lua that appends to the table `out` the value of each live member's key
    (`key_prefix .. id`, for each id in the set `set_key`) and removes from the set the ids
    whose key is gone (a lease that lapsed); `skip`, an id to leave out. The arguments are
    Lua expressions (``KEYS[1]``, ``ARGV[2]``)."""
    keep = f"if id ~= {skip} then" if skip else "do"
    return f"""
for _, id in ipairs(redis.call('SMEMBERS', {set_key})) do
  {keep}
    local v = redis.call('GET', {key_prefix} .. id)
    if v then
      table.insert(out, v)
    else
      redis.call('SREM', {set_key}, id)
    end
  end
end
"""


class ControlStore(AsyncResource):
    """A namespace of the control plane in one Redis.

    Every command goes through `call`, bounded by `op_timeout_s`; failures surface as
    ControlPlaneError. Use it as ``async with ...from_url(url, namespace=...) as store:``;
    leaving the block closes the Redis client if the store created it.
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
        if not namespace or ":" in namespace:
            raise ValueError(f"namespace must be non-empty without ':', got {namespace!r}")
        self._redis = client
        self._owns_client = owns_client
        self.namespace = namespace
        self.op_timeout_s = op_timeout_s
        self._prefix = f"pdserve:{namespace}:"
        self.signer = signer  # None: the open mode, records neither signed nor checked
        # Commands still running (`call` shields them), for close() to end first: redis-py's
        # pool has no closed state, so a command that gets a connection after the pool was
        # closed opens a new one that nobody closes (a socket left to the garbage collector).
        self._running: set[asyncio.Future[Any]] = set()
        self._closed = False
        # Whoever writes junk into Redis cannot flood the log (readers poll every fraction
        # of a second): one line per kind per 30 s, with a count.
        self._rejected = RateLimitedLog(log, "control_record_refused")
        # Worker records as last listed, by their exact bytes, with when they were signed:
        # the directory reads every record several times per heartbeat, and verifying and
        # parsing the same bytes again was most of a poll's CPU. Only a signed record's age
        # is checked again. Replaced by each listing, so it holds one listing's records.
        self._decoded: dict[str | bytes, tuple[WorkerInfo, float | None]] = {}

    @classmethod
    def from_url(cls, url: str, *, namespace: str = "default", op_timeout_s: float = 2.0,
                 signer: RecordSigner | None = None) -> Self:
        """A store with its own client. The URL may carry a password or ACL user
        (``redis://user:pw@host:port/0``) and TLS (``rediss://...?ssl_ca_certs=/path``); its
        query options pass through to redis-py. Retries are few and quick so that a command
        ends within a few `op_timeout_s` and the client reconnects as soon as Redis is back
        (redis-py's default backoff grows to seconds between attempts)."""
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=op_timeout_s,
            socket_connect_timeout=op_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
        )
        return cls(client, namespace=namespace, op_timeout_s=op_timeout_s, owns_client=True,
                   signer=signer)


    async def close(self) -> None:
        """Close the client if this store created it: one bounded attempt, never raises
        for an unreachable Redis. Commands still running are cancelled first (an XREAD
        blocked in Redis too; their callers get ControlPlaneError): left running, redis-py
        would retry one that lost its connection on a new one, opened after the pool closed
        and never closed. Later commands fail with ControlPlaneError."""
        self._closed = True
        for task in self._running:
            task.cancel()
        try:
            async with asyncio.timeout(self.op_timeout_s):
                if self._running:
                    await asyncio.wait(self._running)
                if self._owns_client:
                    await self._redis.aclose()
        except (TimeoutError, RedisError, OSError) as err:
            log.warning("redis_close_failed", error=str(err) or type(err).__name__)

    # ------------------------------------------------------------------ keys

    def key(self, suffix: str) -> str:
        """A key of this namespace (``pdserve:{namespace}:{suffix}``), for other parts of the
        control plane that share this store's client (pdserve.control.kv_events)."""
        return self._prefix + suffix

    @property
    def redis(self) -> aioredis.Redis:
        """The client; commands on it go through `call` to keep their bound."""
        return self._redis

    def worker_key(self, worker_id: str) -> str:
        return f"{self._prefix}worker:{worker_id}"

    def descriptor_key(self, descriptor_id: str) -> str:
        return f"{self._prefix}kvdesc:{descriptor_id}"

    def _epoch_key(self, worker_id: str) -> str:
        return f"{self._prefix}epoch:{worker_id}"

    @property
    def _workers_key(self) -> str:
        return f"{self._prefix}workers"

    # ------------------------------------------------------------------ records

    def _encode_worker(self, info: WorkerInfo) -> str:
        if self.signer is None:
            return info.to_json()
        return self.signer.sign_json("worker", json.loads(info.to_json()), timestamp=True)

    def _decode_worker(self, raw: str | bytes,
                       listed: dict[str | bytes, tuple[WorkerInfo, float | None]] | None = None
                       ) -> WorkerInfo | None:
        """A record from Redis, or None (logged, rate-limited) if it is malformed or, with a
        signer, unsigned, mis-signed or stale: such a record is never used. `listed`: the
        new listing's cache (`_decoded`), which the record joins."""
        try:
            if (hit := self._decoded.get(raw)) is not None:
                info, signed_at = hit
                if self.signer is not None:
                    if signed_at is None:
                        raise SignatureError("record has no signing time")
                    self.signer.check_age(signed_at)
            elif self.signer is not None:
                data, signed_at = self.signer.verify_timestamped("worker", raw)
                info = WorkerInfo.from_dict(data)
            else:
                info, signed_at = WorkerInfo.from_json(raw), None
        except (SignatureError, WorkerInfoError) as err:
            self._rejected("worker", kind="worker", error=str(err))
            return None
        if listed is not None:
            listed[raw] = (info, signed_at)
        return info

    def _encode_descriptor(self, desc: KVDescriptor) -> str:
        raw = desc.to_json()
        if self.signer is None:
            return raw
        return self.signer.sign_json("kvdesc", json.loads(raw))

    def _decode_descriptor(self, descriptor_id: str, raw: str | bytes) -> KVDescriptor | None:
        """The descriptor stored under `descriptor_id`, or None if, with a signer, it was not
        written by a member of this cluster (logged, rate-limited) or it names another id;
        ControlPlaneError if it is unreadable."""
        if self.signer is not None:
            try:
                raw = json.dumps(self.signer.verify_json("kvdesc", raw))
            except SignatureError as err:
                self._rejected("kvdesc", kind="kvdesc", error=str(err))
                return None
        try:
            desc = KVDescriptor.from_json(raw)
        except DescriptorFormatError as err:
            raise ControlPlaneError(f"descriptor {descriptor_id!r} is unreadable: {err}") from err
        return desc if desc.descriptor_id == descriptor_id else None

    # ------------------------------------------------------------------ commands

    async def call(self, op: Awaitable[T], *, timeout_s: float | None = None) -> T:
        """Await one Redis command, bounded by `op_timeout_s` (or `timeout_s`).

        The command runs in its own task behind `asyncio.shield`: a timeout (or the caller
        being cancelled) abandons the wait but never cancels redis-py mid-command, which can
        leave a pooled connection half-read so that a later command on it hangs or reads
        another command's reply. The abandoned command ends by itself within the client's
        socket timeouts (set to `op_timeout_s` by `from_url`) and returns its connection."""
        if self._closed:
            if inspect.iscoroutine(op):
                op.close()  # never started: nothing to await
            raise ControlPlaneError("the control-plane store is closed")
        task = asyncio.ensure_future(op)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        bound = self.op_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(bound):
                return await asyncio.shield(task)
        except TimeoutError as exc:
            task.add_done_callback(_consume)
            raise ControlPlaneError(f"redis did not answer within {bound}s") from exc
        except asyncio.CancelledError:
            task.add_done_callback(_consume)
            current = asyncio.current_task()
            if task.cancelled() and self._closed and current is not None \
                    and not current.cancelling():  # the command was, by close(); not the caller
                raise ControlPlaneError("the control-plane store closed during the command") \
                    from None
            raise
        except RedisError as exc:
            raise ControlPlaneError(f"redis error: {exc}") from exc


def _consume(task: asyncio.Future[T]) -> None:
    """Retrieve an abandoned command's outcome so asyncio does not log it as never awaited."""
    if not task.cancelled():
        task.exception()
