"""Router replicas' in-flight counts on the control plane's Redis.

Each router keeps books of what it placed (router.ledger.PlacementLedger): per decode worker,
the requests it placed there and has not seen finish, and those that left it since the load
it last saw from it was taken. Another router's placements reach it only through heartbeats,
up to a second late, so two routers each sending an arrival of the same instant both picked
the worker that looked idler (docs/bench/placement_s80/herd2: 5 of 15 bursts went all to one
worker with two routers, none of 20 with one). Here every router writes its own counts and
reads the others' in one round trip, a few times a second (`exchange`). That alone left a
window of a period and more: two arrivals 40-100 ms apart at two routers still went to the
same worker, turn after turn (docs/bench/placement_s81/share). So a router whose counts
changed also pushes them at once (`push`: the same record, written and PUBLISHed on the
namespace's channel), and every router follows the channel (`follow`): another router's
placement reaches it within a round trip or two. The periodic exchange stays the truth for
who is alive; a push that was lost (no subscriber connected) is made good by the next one.

Keys, under the registry's ``pdserve:{namespace}:``:

- ``inflight:{router_id}``  one router's counts (`InflightCounts` as JSON), a lease: written
  with PX `ttl_s` by each exchange, so a router that stops (or cannot reach Redis) drops out
  within `ttl_s`.
- ``routers``               the set of router ids that wrote counts; a reader prunes ids whose
  key lapsed.
- ``inflight``              the pub/sub channel every write is published on.

Nothing read here is trusted because it is in Redis: with a cluster secret each record is
signed by its router (kind ``inflight``, with its signing time: pdserve.control.signing),
and every record is parsed strictly and bounded (`MAX_WORKERS` entries, counts in
0..`MAX_COUNT`, worker ids of at most `MAX_WORKER_ID` characters). A record that fails is dropped
(logged, rate-limited): at worst a router places as if that peer did not exist.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import re
import secrets
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import structlog
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from pdserve.control.registry import WorkerRegistry
from pdserve.control.signing import SignatureError
from pdserve.control.store import live_records_lua
from pdserve.ratelog import RateLimitedLog

__all__ = ["InflightBoard", "InflightCounts", "InflightRecordError", "new_router_id", "newest"]

log = structlog.get_logger(__name__)

MAX_WORKERS = 4096  # entries per count in one record
MAX_COUNT = 1 << 20  # requests on one worker
WRITTEN_KEPT = 64  # this router's last records, kept to drop them as they come back
MAX_WORKER_ID = 256  # characters (an id no worker has only never matches one)
_ROUTER_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")

# KEYS[1] this router's key, KEYS[2] the routers set. ARGV: record, ttl ms, router id, key
# prefix of every router's counts, channel, '1' to read the others. Writes ours and
# publishes it; returns the others' live records (pruning ids whose key lapsed) if asked.
_EXCHANGE_LUA = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('PUBLISH', ARGV[5], ARGV[1])
local out = {}
if ARGV[6] ~= '1' then
  return out
end
""" + live_records_lua("KEYS[2]", "ARGV[4]", skip="ARGV[3]") + "return out"

# KEYS[1] this router's key, KEYS[2] the routers set; ARGV[1] router id.
_LEAVE_LUA = """
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""


class InflightRecordError(ValueError):
    """A router's in-flight record is malformed."""


def new_router_id() -> str:
    """A router process's id: host, pid and a random suffix (a restarted router is another)."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class InflightCounts:
    """One router's books, per decode worker: `placed`, its requests running there;
    `finished`, those that left it since the worker's load with tag `tag` was taken
    (worker -> (count, tag); router.ledger.load_tag), which that load still counts. `seq`
    grows with each record a router writes: of two, the later wins (a push can overtake the
    read of an exchange)."""

    router_id: str
    placed: Mapping[str, int] = field(default_factory=dict)
    finished: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    seq: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"router": self.router_id, "seq": self.seq, "placed": dict(self.placed),
                "finished": {w: [n, t] for w, (n, t) in self.finished.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> InflightCounts:
        router_id, seq = data.get("router"), data.get("seq")
        if not isinstance(router_id, str) or not _ROUTER_ID.fullmatch(router_id):
            raise InflightRecordError("bad router id")
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 1 << 63:
            raise InflightRecordError("bad seq")
        return cls(router_id, _entries(data.get("placed"), "placed"),
                   _entries(data.get("finished"), "finished", pairs=True), seq)


def newest(counts: Iterable[InflightCounts],
           known: Mapping[str, InflightCounts] = MappingProxyType({})) -> dict[str, InflightCounts]:
    """Per router, the later of its record in `counts` and in `known`, the one held in
    `known` where both are the same record (same `seq`); `known`'s other routers are left
    out: `counts` says who is alive."""
    out = {}
    for c in counts:
        old = known.get(c.router_id)
        out[c.router_id] = old if old is not None and old.seq >= c.seq else c
    return out


def _count(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
        raise InflightRecordError(f"count out of range: {v!r}")
    return v


def _entries(raw: object, what: str, *, pairs: bool = False) -> dict[str, Any]:
    if not isinstance(raw, dict) or len(raw) > MAX_WORKERS:
        raise InflightRecordError(f"{what}: not an object of at most {MAX_WORKERS} entries")
    out: dict[str, Any] = {}
    for w, v in raw.items():
        if not 0 < len(w) <= MAX_WORKER_ID:
            raise InflightRecordError(f"{what}: bad worker id")
        if pairs:
            if not isinstance(v, list) or len(v) != 2 or isinstance(v[1], bool) \
                    or not isinstance(v[1], int) or not 0 <= v[1] < 1 << 32:
                raise InflightRecordError(f"{what}: not [count, tag]")
            out[w] = (_count(v[0]), v[1])
        else:
            out[w] = _count(v)
    return out


class InflightBoard:
    """Every router's in-flight counts in one namespace, over a registry's Redis client and
    its bounds (each exchange is one command bounded by the registry's `op_timeout_s`;
    failures raise ControlPlaneError)."""

    def __init__(self, registry: WorkerRegistry, router_id: str, *, ttl_s: float = 2.0) -> None:
        if not _ROUTER_ID.fullmatch(router_id):
            raise ValueError(f"router id must match {_ROUTER_ID.pattern}, got {router_id!r}")
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError("ttl_s must be > 0")
        self.registry = registry
        self.router_id = router_id
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self._prefix = registry.key("inflight:")
        self._key = self._prefix + router_id
        self._set = registry.key("routers")
        self._channel = registry.key("inflight")
        self._exchange = registry.redis.register_script(_EXCHANGE_LUA)
        self._leave = registry.redis.register_script(_LEAVE_LUA)
        self._rejected = RateLimitedLog(log, "inflight_record_refused")
        self._lost = RateLimitedLog(log, "inflight_follow_failed")
        self._seq = itertools.count(1)
        # This router's last records as written: the channel brings them back to it too
        # (`follow`), and one of them is dropped as it is, not parsed and verified first.
        self._written: dict[bytes, None] = {}
        self._closing: set[asyncio.Future[None]] = set()  # subscriptions being closed

    def _encode(self, counts: InflightCounts) -> str:
        signer = self.registry.signer
        if signer is None:
            return json.dumps(counts.to_dict(), separators=(",", ":"))
        return signer.sign_json("inflight", counts.to_dict(), timestamp=True)

    def _decode(self, raw: str | bytes) -> InflightCounts | None:
        signer = self.registry.signer
        try:
            if signer is not None:
                data = signer.verify_json("inflight", raw, timestamp=True)
            else:
                data = json.loads(raw)
                if not isinstance(data, dict):
                    raise InflightRecordError("not a JSON object")
            counts = InflightCounts.from_dict(data)
        except (SignatureError, InflightRecordError, ValueError) as err:
            self._rejected("inflight", error=str(err))
            return None
        return None if counts.router_id == self.router_id else counts

    async def exchange(self, placed: Mapping[str, int],
                       finished: Mapping[str, tuple[int, int]]) -> list[InflightCounts]:
        """Write this router's counts (renewing its lease; pushed to the followers too) and
        read every other live router's, in one round trip."""
        raws = await self._write(placed, finished, read=True)
        return [c for c in map(self._decode, raws) if c is not None]

    async def push(self, placed: Mapping[str, int],
                   finished: Mapping[str, tuple[int, int]]) -> None:
        """Write this router's counts and publish them to the followers (`follow`)."""
        await self._write(placed, finished, read=False)

    async def _write(self, placed: Mapping[str, int], finished: Mapping[str, tuple[int, int]],
                     *, read: bool) -> list[bytes]:
        record = self._encode(InflightCounts(self.router_id, placed, finished, next(self._seq)))
        self._written[record.encode()] = None
        if len(self._written) > WRITTEN_KEPT:  # not followed back (yet): the oldest goes
            del self._written[next(iter(self._written))]
        raws: list[bytes] = await self.registry.call(self._exchange(
            keys=[self._key, self._set],
            args=[record, self.ttl_ms, self.router_id, self._prefix, self._channel,
                  "1" if read else "0"]))
        return raws

    async def follow(self, on_counts: Callable[[InflightCounts], None], *,
                     retry_s: float = 0.5) -> None:
        """Until cancelled: each other router's counts as it writes them, to `on_counts`
        (on the event loop). A lost subscription is made again after `retry_s` (meanwhile
        the periodic exchanges still bring the counts)."""
        while True:
            pubsub = self.registry.redis.pubsub(ignore_subscribe_messages=True)
            try:
                async with asyncio.timeout(self.registry.op_timeout_s):
                    await pubsub.subscribe(self._channel)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                       timeout=1.0)
                    if message is None or message.get("type") != "message":
                        continue
                    if self._written.pop(message["data"], False) is None:
                        continue  # this router's own, back
                    counts = self._decode(message["data"])
                    if counts is not None:
                        on_counts(counts)
            except (RedisError, OSError, TimeoutError) as err:
                self._lost("follow", error=str(err) or type(err).__name__)
            finally:
                await self._close_subscription(pubsub)
            await asyncio.sleep(retry_s)

    async def _close_subscription(self, pubsub: PubSub) -> None:
        """Close `pubsub` within the registry's `op_timeout_s`. redis-py's `PubSub.aclose`
        waits for its teardown however often it is cancelled, and that teardown can stall
        (redis/redis-py#3941): it runs as a task of its own, waited for within the bound,
        else left to end by itself, so that `follow` always ends when it is cancelled."""
        closing = asyncio.ensure_future(pubsub.aclose())
        self._closing.add(closing)
        closing.add_done_callback(self._closed)
        await asyncio.wait({closing}, timeout=self.registry.op_timeout_s)

    def _closed(self, closing: asyncio.Future[None]) -> None:
        self._closing.discard(closing)
        if not closing.cancelled() and (err := closing.exception()) is not None:
            self._lost("close", error=str(err) or type(err).__name__)

    async def leave(self) -> None:
        """Take this router's counts off at once (a clean stop), not after `ttl_s`."""
        await self.registry.call(self._leave(keys=[self._key, self._set],
                                             args=[self.router_id]))
