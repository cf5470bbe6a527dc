"""Which writer connections a KVReceiver serves, and for how long.

The listener is reachable before anyone authenticated. A connection is *unauthenticated*
until a frame on it passes `KVAuth.check` (a signed write or a signed ping from a registered
prefill worker; without `auth`, until a write is accepted). Unsigned pings and refused writes
never earn anything. An unauthenticated connection must send each frame within
`frame_timeout_s` and at most `max_unauthenticated` of them are kept, the oldest dropped for a
new one, so junk never holds a slot a prefill worker needs; one whose write fails
authentication gets its ``reject`` and is disconnected. At most `max_connections`
authenticated ones are served; they may idle up to `idle_timeout_s` (never while a transfer
runs over them). A signed frame is taken once: a replay within the clock skew is refused.
Warnings a peer can trigger are rate-limited (`pdserve.ratelog`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from typing import Any

import structlog

from kvxfer.auth import KVAuth
from kvxfer.inbound import Connection
from kvxfer.pool import DIGEST_HEX_CHARS
from kvxfer.protocol import CTRL_TAG, check_open, new_header, recv_payload
from pdserve.errors import ErrorCode
from pdserve.ratelog import RateLimitedLog

log = structlog.get_logger(__name__)

_FRAME_BASE_BYTES = 64 << 10  # a request's fixed part (ids, layout, notice) fits in this ...
_FRAME_BYTES_PER_BLOCK = 32 + DIGEST_HEX_CHARS + 3  # ... plus a run and its digest per block
PEER_EVENTS = ("kv_bad_frame", "kv_connection_evicted", "kv_connection_refused",
               "kv_reply_failed", "kv_write_unauthenticated", "kv_write_rejected")
_REFUSED_LINGER_S = 0.5  # a refused peer's reject gets this long to be read before we hang up
_NONCE_MEMORY = 1 << 17  # signed frames remembered (within the clock skew) to refuse replays


class Idle(Exception):
    """A connection sent nothing for longer than it may idle."""


class ConnectionGate:
    """The receiver's connections and their bounds (see the module docstring): admits and
    evicts them, reads each one's next frame within its time limit, authenticates them, and
    logs what a peer can trigger (`warn`). Frames may name up to `num_blocks` blocks."""

    def __init__(
        self,
        auth: KVAuth | None,
        num_blocks: int,
        *,
        frame_timeout_s: float,
        idle_timeout_s: float,
        max_connections: int,
        max_unauthenticated: int,
        log_interval_s: float,
    ) -> None:
        self._auth = auth
        self._frame_timeout_s = frame_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._max_connections = max_connections
        self._max_unauthenticated = max_unauthenticated
        # What a peer can make us log, at most one line per event and key per interval.
        self.peer_logs = {event: RateLimitedLog(log, event, interval_s=log_interval_s)
                          for event in PEER_EVENTS}
        self._nonces: collections.OrderedDict[str, float] = collections.OrderedDict()
        # The largest request a writer can need: a write naming every block as its own run.
        self.max_frame_bytes = _FRAME_BASE_BYTES + _FRAME_BYTES_PER_BLOCK * num_blocks
        self.conns: set[Connection] = set()
        self.unauthenticated: dict[Connection, None] = {}  # oldest first

    def warn(self, event: str, key: str, **fields: Any) -> None:
        self.peer_logs[event](key, **fields)

    def connection(self, ep: Any) -> Connection:
        """A new connection's record (not admitted yet)."""
        return Connection(ep, peer=f"ep-{ep.uid:#x}",
                          warn=functools.partial(self.warn, "kv_reply_failed", "reply"))

    def admit(self, conn: Connection) -> None:
        """Serve `conn` as unauthenticated, evicting the oldest such one if there are too
        many."""
        while len(self.unauthenticated) >= max(1, self._max_unauthenticated):
            # The oldest, but not one whose signature already verified (only a holder of the
            # secret gets that far) while its sender is looked up.
            oldest = next((c for c in self.unauthenticated if not c.checking),
                          next(iter(self.unauthenticated)))
            del self.unauthenticated[oldest]
            self.conns.discard(oldest)  # no longer served; its handler ends on the abort
            self.warn("kv_connection_evicted", "evicted", peer=oldest.peer,
                      reason="too many unauthenticated connections",
                      limit=self._max_unauthenticated)
            oldest.abort("evicted")
        self.conns.add(conn)
        self.unauthenticated[conn] = None

    def leave(self, conn: Connection) -> None:
        """`conn` is no longer served."""
        self.conns.discard(conn)
        self.unauthenticated.pop(conn, None)

    async def next_frame(self, conn: Connection) -> dict[str, Any]:
        """The connection's next request. Its first byte must come within `frame_timeout_s`
        (`idle_timeout_s` once authenticated, unbounded while a transfer runs over it), the
        rest within `frame_timeout_s`. Raises Idle, TimeoutError, ProtocolError, UCXError."""
        header = new_header()
        check_open(conn.ep)
        # Waited on, never cancelled while the endpoint lives: a cancelled UCX receive could
        # still swallow the next request. The endpoint's abort (by our caller) ends it.
        first = asyncio.ensure_future(conn.ep.recv(header, tag=CTRL_TAG))
        first.add_done_callback(lambda f: f.cancelled() or f.exception())
        idle_since = time.monotonic()
        while not first.done():
            limit = self._idle_timeout_s if conn.authenticated else self._frame_timeout_s
            await asyncio.wait({first}, timeout=max(0.0, idle_since + limit - time.monotonic()))
            if first.done():
                break
            if conn.active:
                idle_since = time.monotonic()  # a transfer is running: not idle
            elif time.monotonic() - idle_since >= limit:
                if conn.authenticated:
                    log.info("kv_connection_idle", peer=conn.peer, idle_s=limit)
                    raise Idle
                raise TimeoutError
        check_open(conn.ep)  # evicted: the receive failed inside ucxx on the aborted endpoint
        first.result()
        async with asyncio.timeout(self._frame_timeout_s):
            return await recv_payload(conn.ep, CTRL_TAG, header, self.max_frame_bytes)

    async def authenticate(self, conn: Connection, seq: int, msg: dict[str, Any]) -> bool:
        """Check a signed frame (with `auth`); True if the connection may go on. A refused
        one gets a ``reject`` and False: the caller disconnects it."""
        assert self._auth is not None
        conn.checking = True
        try:
            problem = await self._auth.check(msg)
        finally:
            conn.checking = False
        if problem is None:
            problem = self._replayed(msg)
        if problem is not None:
            # Refused before the transfer is even looked up: a forger changes nothing.
            self.warn("kv_write_unauthenticated", "refused", peer=conn.peer,
                      reason=problem)
            reject = {"op": "reject", "code": ErrorCode.KV_UNAUTHENTICATED, "message": problem}
            if await conn.reply(seq, reject, self._frame_timeout_s):
                # ucxx fails a receive on a reset endpoint even when the reply is queued:
                # let the writer read why before we hang up (it stays evictable meanwhile).
                await asyncio.sleep(min(_REFUSED_LINGER_S, self._frame_timeout_s))
            return False
        return await self.promote(conn, seq)

    async def promote(self, conn: Connection, seq: int) -> bool:
        """Count `conn` as authenticated, if there is room: else reject and False."""
        if conn.authenticated:
            return True
        if conn.ep.closed:  # evicted or closed meanwhile
            return False
        if len(self.conns) - len(self.unauthenticated) >= self._max_connections:
            self.warn("kv_connection_refused", "full", peer=conn.peer,
                      reason="too many connections", limit=self._max_connections)
            reject = {"op": "reject", "code": ErrorCode.KV_TOO_MANY_CONNECTIONS,
                      "message": f"this receiver serves {self._max_connections} writers"}
            await conn.reply(seq, reject, self._frame_timeout_s)
            return False
        conn.authenticated = True
        self.unauthenticated.pop(conn, None)
        return True

    def _replayed(self, msg: dict[str, Any]) -> str | None:
        """Each signed frame is taken once: a copy replayed within the clock skew is refused
        (it could otherwise authenticate an attacker's connection)."""
        assert self._auth is not None
        now = time.time()
        while self._nonces and (len(self._nonces) >= _NONCE_MEMORY
                                or next(iter(self._nonces.values())) < now):
            self._nonces.popitem(last=False)
        key = f"{msg.get('sender_id')}\x00{msg.get('nonce')}"
        if key in self._nonces:
            return "the frame was already received (a replay)"
        self._nonces[key] = now + 2 * self._auth.max_skew_s
        return None
