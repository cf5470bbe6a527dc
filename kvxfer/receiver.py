"""Decode side of a KV transfer: accept writes from prefill workers straight into the pool.

Lifecycle of one transfer, keyed by `transfer_id`:

    expect() -> PENDING --writer's request accepted--> ACTIVE --all bytes landed--> DONE
                   |                                      |
                   +-- timeout / cancel() ----------------+--> FAILED (after the fence)

The fence: a transfer is only reported finished (its `Expectation` resolves or raises, or
`cancel()` returns) once no byte can land in its blocks any more. For an ACTIVE transfer
that means every recv posted into the pool has completed or been cancelled by UCX. We first
give in-flight recvs `fence_grace_s` to complete; if they do not, the endpoint they were
posted on is aborted (failing any other transfer from that same peer) and we wait for UCX to
report them cancelled. Only if UCX does not report back within `fence_timeout_s` do we give
up: the error then has code ``kv_fence_failed`` and the blocks must never be reused.

Integrity: a write request carries a BLAKE3 digest of each run's bytes (`kvxfer.pool.digest`),
covered by its signature. Each run is hashed as soon as it landed, while later runs still
arrive; a transfer is DONE only once every digest matched, else it fails with
``kv_integrity_failed`` like any failed transfer (fenced, never handed to the engine). With
`auth` the digests are required; without, they are checked when present (they then catch
corruption, not an on-path attacker, who could rewrite them too).

Connections (the listener is reachable before anyone authenticated): a connection is
*unauthenticated* until a frame on it passes `KVAuth.check` (a signed write or a signed ping
from a registered prefill worker; without `auth`, until a write is accepted). Unsigned pings
and refused writes never earn anything. An unauthenticated connection must send each frame
within `frame_timeout_s` and at most `max_unauthenticated` of them are kept, the oldest
dropped for a new one, so junk never holds a slot a prefill worker needs; one whose write
fails authentication gets its ``reject`` and is disconnected. At most `max_connections`
authenticated ones are served; they may idle up to `idle_timeout_s` (never while a transfer
runs over them). Warnings a peer can trigger are rate-limited (`pdserve.ratelog`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import functools
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, cast

import structlog
import torch

from kvxfer import listen
from kvxfer.auth import MAC_FIELD, KVAuth
from kvxfer.pool import DIGEST_HEX_CHARS, INLINE_DIGEST_BYTES, PoolBytes, check_blocks, digest
from kvxfer.protocol import (
    CTRL_TAG,
    SEQ_LIMIT,
    Code,
    ProtocolError,
    UCXError,
    check_open,
    data_tag,
    error,
    new_header,
    recv_payload,
    reply_tag,
    send_frame,
)
from kvxfer.runs import expand_runs
from pdserve.ratelog import RateLimitedLog
from pdserve.types import KVLayout, KVTransferError

log = structlog.get_logger(__name__)

_ABORT_PERIOD_NS = 1_000_000_000  # bound on ucxx's blocking endpoint close
_FINISHED_MEMORY = 4096  # finished transfer ids remembered, for clearer late-writer errors
_FRAME_BASE_BYTES = 64 << 10  # a request's fixed part (ids, layout, notice) fits in this ...
_FRAME_BYTES_PER_BLOCK = 32 + DIGEST_HEX_CHARS + 3  # ... plus a run and its digest per block
_PEER_EVENTS = ("kv_bad_frame", "kv_connection_evicted", "kv_connection_refused",
                "kv_reply_failed", "kv_write_unauthenticated", "kv_write_rejected")
_REFUSED_LINGER_S = 0.5  # a refused peer's reject gets this long to be read before we hang up
_NONCE_MEMORY = 1 << 17  # signed frames remembered (within the clock skew) to refuse replays


class _State(enum.Enum):
    PENDING = "pending"
    ACTIVE = "active"
    DONE = "done"
    FAILED = "failed"


Notice = dict[str, Any]


class Expectation:
    """Awaitable for one expected transfer: once every byte landed it returns the writer's
    notice (a small JSON object sent along with the blocks, or None), else it raises
    KVTransferError. Either way, no byte lands in the blocks after it finished. Awaiting it
    again gives the same outcome; cancelling the awaiting task does not cancel the transfer
    (use `KVReceiver.cancel`).
    """

    def __init__(
        self, transfer_id: str, dst_block_ids: tuple[int, ...], fut: asyncio.Future[Notice | None]
    ):
        self.transfer_id = transfer_id
        self.dst_block_ids = dst_block_ids
        self._future = fut

    def done(self) -> bool:
        return self._future.done()

    def __await__(self) -> Generator[Any, None, Notice | None]:
        return asyncio.shield(self._future).__await__()


class _Idle(Exception):
    """A connection sent nothing for longer than it may idle."""


@dataclass(eq=False)
class _Connection:
    ep: Any  # ucxx Endpoint
    peer: str
    warn: Callable[..., Any]  # rate-limited: a peer that never reads replies could flood
    authenticated: bool = False
    checking: bool = False  # a validly signed frame's sender is being looked up
    active: int = 0  # transfers running over it: it is not idle while one is

    def abort(self, reason: str, *, fencing: bool = False) -> None:
        if not self.ep.closed:
            (log.warning if fencing else log.debug)(
                "kv_endpoint_aborted", peer=self.peer, reason=reason
            )
        with contextlib.suppress(UCXError):
            self.ep.abort(period=_ABORT_PERIOD_NS)

    async def reply(self, seq: int, message: dict[str, Any], timeout_s: float) -> bool:
        """Best effort: False if the peer is gone or too slow to take a small frame."""
        if self.ep.closed:
            return False
        try:
            await send_frame(self.ep, reply_tag(seq), message, timeout_s)
            return True
        except (UCXError, TimeoutError) as exc:
            if self.ep.closed:  # we dropped it meanwhile (evicted, fenced, closing)
                log.debug("kv_reply_dropped", peer=self.peer, op=message["op"])
            else:
                self.warn(peer=self.peer, op=message["op"], error=repr(exc))
            return False


@dataclass(eq=False)
class _Transfer:
    transfer_id: str
    dst_block_ids: tuple[int, ...]
    deadline: float  # loop.time()
    future: asyncio.Future[Notice | None]
    notice: Notice | None = None
    runs: list[tuple[int, int]] = field(default_factory=list)
    digests: list[str] | None = None  # one per run, from the signed request
    timer: asyncio.TimerHandle | None = None
    state: _State = _State.PENDING
    recvs: list[asyncio.Task[Any]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # cancel() while ACTIVE
    stop_reason: KVTransferError | None = None
    fenced: asyncio.Event = field(default_factory=asyncio.Event)
    fence_ok: bool = True


class KVReceiver:
    """Accepts KV block writes into `pool` (a tensor laid out as `layout`) over UCX.

    `descriptor_id` names this pool incarnation (``"{worker_id}:{epoch}"``); writers that
    address another one are rejected. `host` is the address advertised in `address`; the UCX
    listener binds `bind_host` (default: `host`; "0.0.0.0" for every interface; see
    `kvxfer.listen`). With `auth`, only signed writes from authorized senders are served
    (`kvxfer.auth`). Use as ``async with KVReceiver(...) as rx:``.
    """

    def __init__(
        self,
        pool: torch.Tensor,
        layout: KVLayout,
        descriptor_id: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        bind_host: str | None = None,
        frame_timeout_s: float = 5.0,
        fence_grace_s: float = 0.25,
        fence_timeout_s: float = 10.0,
        auth: KVAuth | None = None,
        max_connections: int = 256,
        max_unauthenticated: int = 32,
        idle_timeout_s: float = 300.0,
        log_interval_s: float = 30.0,
    ) -> None:
        self._pool = PoolBytes(pool, layout)
        self.layout = layout
        self.descriptor_id = descriptor_id
        self._host = host
        self._bind_host = host if bind_host is None else bind_host
        self._port = port
        self._frame_timeout_s = frame_timeout_s
        self._fence_grace_s = fence_grace_s
        self._fence_timeout_s = fence_timeout_s
        self._auth = auth
        self._max_connections = max_connections
        self._max_unauthenticated = max_unauthenticated
        self._idle_timeout_s = idle_timeout_s
        # What a peer can make us log, at most one line per event and key per interval.
        self._peer_logs = {event: RateLimitedLog(log, event, interval_s=log_interval_s)
                           for event in _PEER_EVENTS}
        self._nonces: collections.OrderedDict[str, float] = collections.OrderedDict()
        # The largest request a writer can need: a write naming every block as its own run.
        self._max_frame_bytes = _FRAME_BASE_BYTES + _FRAME_BYTES_PER_BLOCK * layout.num_blocks
        self._listener: Any = None
        self._bound_port: int | None = None
        self._closing = False
        self._transfers: dict[str, _Transfer] = {}
        self._finished: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._conns: set[_Connection] = set()
        self._unauthenticated: dict[_Connection, None] = {}  # oldest first
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        if self._listener is None:
            self._listener = listen.create_listener(self._serve, host=self._bind_host,
                                                    port=self._port)
            self._bound_port = int(self._listener.port)
            log.info("kv_receiver_listening", address=self.address, descriptor=self.descriptor_id)

    @property
    def address(self) -> str:
        """``"host:port"`` for KVDescriptor.ucx_address."""
        if self._bound_port is None:
            raise RuntimeError("KVReceiver is not started")
        return f"{self._host}:{self._bound_port}"

    async def close(self) -> None:
        """Fail every open transfer (fenced), drop all endpoints and stop listening."""
        self._closing = True
        for transfer_id in list(self._transfers):
            with contextlib.suppress(KVTransferError):
                await self.cancel(transfer_id, reason="receiver closed")
        for conn in list(self._conns):
            conn.abort("receiver closed")
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self._fence_timeout_s)
        for _ in range(100):  # ucxx retires each handler a moment after it returned
            if self._listener is None or not self._listener.active_clients:
                break
            await asyncio.sleep(0.01)
        if self._listener is not None:
            self._listener.close()  # after the handlers returned, which ucxx expects
            self._listener = None  # ucxx unbinds the port once the last reference is gone

    # ------------------------------------------------------------------ decode-side API

    def expect(
        self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float
    ) -> Expectation:
        """Allow one writer to fill `dst_block_ids` within `timeout_s`.

        The writer must send exactly these blocks (in any order). Raises KVTransferError with
        code ``kv_invalid_argument`` for an empty, duplicated or out-of-range id list or a
        transfer id already in use.
        """
        if self._closing:
            raise error(Code.CLOSED, "receiver is closed")
        blocks = tuple(dst_block_ids)
        try:
            if not transfer_id:
                raise ValueError("transfer_id must not be empty")
            if not blocks:
                raise ValueError("dst_block_ids must not be empty")
            check_blocks(blocks, self.layout.num_blocks, "destination")
            if len(set(blocks)) != len(blocks):
                raise ValueError("dst_block_ids contains duplicates")
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            if timeout_s <= 0:
                raise ValueError("timeout_s must be > 0")
        except ValueError as exc:
            raise error(Code.INVALID_ARGUMENT, str(exc)) from None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Notice | None] = loop.create_future()
        # The decode service may cancel and never await: don't warn about unretrieved errors.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        transfer = _Transfer(transfer_id, blocks, loop.time() + timeout_s, fut)
        transfer.timer = loop.call_later(timeout_s, self._pending_expired, transfer)
        self._transfers[transfer_id] = transfer
        return Expectation(transfer_id, blocks, fut)

    async def cancel(self, transfer_id: str, *, reason: str = "cancelled") -> None:
        """Abort a transfer; returns once no byte can land in its blocks any more.

        Only after this returns may the caller free the blocks. A no-op for unknown or
        finished transfers (they are already fenced). Raises KVTransferError with code
        ``kv_fence_failed`` if UCX never confirmed the cancellation: keep those blocks out
        of use.
        """
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            return
        err = error(Code.CANCELLED, f"transfer {transfer_id!r} {reason}")
        if transfer.state is _State.PENDING:
            self._finish(transfer, err)
        elif transfer.state is _State.ACTIVE and transfer.stop_reason is None:
            transfer.stop_reason = err
            transfer.stop.set()
        limit = self._fence_grace_s + self._fence_timeout_s + 1.0
        try:
            async with asyncio.timeout(limit):
                await transfer.fenced.wait()
        except TimeoutError:
            transfer.fence_ok = False
        if not transfer.fence_ok:
            raise error(
                Code.FENCE_FAILED,
                f"transfer {transfer_id!r}: UCX did not confirm that its receives ended; "
                "its blocks must not be reused",
            )

    # ------------------------------------------------------------------ serving writers

    async def _serve(self, ep: Any) -> None:
        """One connected sender: read requests until the endpoint goes away or idles too long
        (see the module docstring for what an unauthenticated connection may do)."""
        conn = _Connection(ep, peer=f"ep-{ep.uid:#x}",
                           warn=functools.partial(self._warn, "kv_reply_failed", "reply"))
        if self._closing:
            conn.abort("receiver closed")
            return
        while len(self._unauthenticated) >= max(1, self._max_unauthenticated):
            # The oldest, but not one whose signature already verified (only a holder of the
            # secret gets that far) while its sender is looked up.
            oldest = next((c for c in self._unauthenticated if not c.checking),
                          next(iter(self._unauthenticated)))
            del self._unauthenticated[oldest]
            self._conns.discard(oldest)  # no longer served; its handler ends on the abort
            self._warn("kv_connection_evicted", "evicted", peer=oldest.peer,
                       reason="too many unauthenticated connections",
                       limit=self._max_unauthenticated)
            oldest.abort("evicted")
        self._conns.add(conn)
        self._unauthenticated[conn] = None
        serving = asyncio.current_task()
        if serving is not None:
            self._tasks.add(serving)
        try:
            while not self._closing and not conn.ep.closed:
                try:
                    msg = await self._next_frame(conn)
                except _Idle:
                    break
                except (ProtocolError, TimeoutError) as exc:
                    self._warn("kv_bad_frame", "frame", peer=conn.peer,
                               error=str(exc) or "timeout")
                    break
                except UCXError:
                    break  # the sender closed or died, or we evicted it
                op, seq = msg.get("op"), msg.get("seq")
                if isinstance(seq, bool) or not isinstance(seq, int) or not 0 < seq < SEQ_LIMIT:
                    self._warn("kv_bad_frame", "frame", peer=conn.peer,
                               error=f"bad seq {seq!r:.40}")
                    break
                if op == "ping":
                    if MAC_FIELD in msg and not await self._authenticate(conn, seq, msg):
                        break
                    pong = {"op": "pong", "descriptor_id": self.descriptor_id}
                    await conn.reply(seq, pong, self._frame_timeout_s)
                elif op == "write":
                    if not await self._on_write(conn, seq, msg):
                        break
                else:
                    reject = {
                        "op": "reject",
                        "code": Code.PROTOCOL_ERROR,
                        "message": f"bad op {op!r:.40}",
                    }
                    await conn.reply(seq, reject, self._frame_timeout_s)
                    if not conn.authenticated:
                        break
        finally:
            self._conns.discard(conn)
            self._unauthenticated.pop(conn, None)
            self._tasks.discard(serving)
            conn.abort("connection closed")

    def _warn(self, event: str, key: str, **fields: Any) -> None:
        self._peer_logs[event](key, **fields)

    async def _next_frame(self, conn: _Connection) -> dict[str, Any]:
        """The connection's next request. Its first byte must come within `frame_timeout_s`
        (`idle_timeout_s` once authenticated, unbounded while a transfer runs over it), the
        rest within `frame_timeout_s`. Raises _Idle, TimeoutError, ProtocolError, UCXError."""
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
                    raise _Idle
                raise TimeoutError
        check_open(conn.ep)  # evicted: the receive failed inside ucxx on the aborted endpoint
        first.result()
        async with asyncio.timeout(self._frame_timeout_s):
            return await recv_payload(conn.ep, CTRL_TAG, header, self._max_frame_bytes)

    async def _authenticate(self, conn: _Connection, seq: int, msg: dict[str, Any]) -> bool:
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
            self._warn("kv_write_unauthenticated", "refused", peer=conn.peer,
                       reason=problem)
            reject = {"op": "reject", "code": Code.UNAUTHENTICATED, "message": problem}
            if await conn.reply(seq, reject, self._frame_timeout_s):
                # ucxx fails a receive on a reset endpoint even when the reply is queued:
                # let the writer read why before we hang up (it stays evictable meanwhile).
                await asyncio.sleep(min(_REFUSED_LINGER_S, self._frame_timeout_s))
            return False
        return await self._promote(conn, seq)

    async def _promote(self, conn: _Connection, seq: int) -> bool:
        """Count `conn` as authenticated, if there is room: else reject and False."""
        if conn.authenticated:
            return True
        if conn.ep.closed:  # evicted or closed meanwhile
            return False
        if len(self._conns) - len(self._unauthenticated) >= self._max_connections:
            self._warn("kv_connection_refused", "full", peer=conn.peer,
                       reason="too many connections", limit=self._max_connections)
            reject = {"op": "reject", "code": Code.TOO_MANY_CONNECTIONS,
                      "message": f"this receiver serves {self._max_connections} writers"}
            await conn.reply(seq, reject, self._frame_timeout_s)
            return False
        conn.authenticated = True
        self._unauthenticated.pop(conn, None)
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

    async def _on_write(self, conn: _Connection, seq: int, msg: dict[str, Any]) -> bool:
        """Serve one write request; False if the connection must be dropped."""
        transfer_id = msg.get("transfer_id")
        if self._auth is not None and not await self._authenticate(conn, seq, msg):
            return False
        try:
            transfer, runs = self._admit(msg)
        except KVTransferError as err:
            self._warn("kv_write_rejected", err.code, peer=conn.peer,
                       transfer_id=str(transfer_id)[:80], code=err.code,
                       reason=err.message)
            reject = {"op": "reject", "code": err.code, "message": err.message}
            await conn.reply(seq, reject, self._frame_timeout_s)
            return True
        if not await self._promote(conn, seq):  # only without `auth`; the transfer stays
            return False  # expected, as after any refused write
        # Accepted: from here on the writer may move bytes into the blocks.
        transfer.state = _State.ACTIVE
        transfer.runs = runs
        if transfer.timer is not None:
            transfer.timer.cancel()
        for index, (start, count) in enumerate(runs):
            buf = self._pool.run(start, count)
            transfer.recvs.append(asyncio.create_task(conn.ep.recv(buf, tag=data_tag(seq, index))))
        conn.active += 1
        task = asyncio.create_task(self._run_transfer(conn, seq, transfer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def _admit(self, msg: dict[str, Any]) -> tuple[_Transfer, list[tuple[int, int]]]:
        """Validate a write request; raises KVTransferError (sent back as a reject).

        A request naming an expected transfer but the wrong blocks or layout also fails that
        transfer: the writer for it is broken and will not send the right data.
        """
        descriptor_id = msg.get("descriptor_id")
        if descriptor_id != self.descriptor_id:
            raise error(
                Code.STALE_DESCRIPTOR,
                f"descriptor {descriptor_id!r} does not name this KV pool (now "
                f"{self.descriptor_id!r}); the decode worker restarted or the descriptor is "
                "forged. Look the descriptor up again.",
            )
        transfer_id = msg.get("transfer_id")
        if not isinstance(transfer_id, str):
            raise error(Code.PROTOCOL_ERROR, "write request has no transfer_id")
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            state = self._finished.get(transfer_id)
            detail = f"already {state}" if state else "not expected (never or no longer)"
            raise error(Code.UNKNOWN_TRANSFER, f"transfer {transfer_id!r} is {detail}")
        if transfer.state is not _State.PENDING:
            raise error(Code.DUPLICATE_TRANSFER, f"transfer {transfer_id!r} already has a writer")
        try:
            runs = self._check_request(msg, transfer)
        except KVTransferError as err:
            self._finish(transfer, err)
            raise
        return transfer, runs

    def _check_request(self, msg: dict[str, Any], transfer: _Transfer) -> list[tuple[int, int]]:
        try:
            layout = KVLayout.from_wire(msg.get("layout"))
        except ValueError as exc:
            raise error(Code.PROTOCOL_ERROR, f"bad layout: {exc}") from None
        if not layout.compatible_with(self.layout):
            raise error(
                Code.LAYOUT_MISMATCH,
                f"sender layout {layout} is not compatible with receiver layout {self.layout}",
            )
        raw_runs = msg.get("runs")
        if not isinstance(raw_runs, list) or not all(
            isinstance(r, list)
            and len(r) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            for r in raw_runs
        ):
            raise error(Code.PROTOCOL_ERROR, "runs must be a list of [start, count] integer pairs")
        notice = msg.get("notice")
        if notice is not None and not isinstance(notice, dict):
            raise error(Code.PROTOCOL_ERROR, "notice must be a JSON object")
        digests = msg.get("digests")
        if digests is None and self._auth is not None:
            raise error(Code.PROTOCOL_ERROR, "a signed write must carry its runs' digests")
        if digests is not None and not (
            isinstance(digests, list)
            and len(digests) == len(raw_runs)
            and all(isinstance(d, str) and len(d) == DIGEST_HEX_CHARS for d in digests)
        ):
            raise error(Code.PROTOCOL_ERROR,
                        f"digests must be one {DIGEST_HEX_CHARS}-character hex string per run")
        transfer.notice = notice
        transfer.digests = digests
        runs = [(start, count) for start, count in raw_runs]
        if any(count < 1 for _, count in runs):
            raise error(Code.PROTOCOL_ERROR, "every run must hold at least one block")
        if sum(count for _, count in runs) != len(transfer.dst_block_ids):
            # Checked before expanding the runs: a declared count is never materialized.
            raise error(
                Code.BLOCK_MISMATCH,
                f"transfer {transfer.transfer_id!r} expects {len(transfer.dst_block_ids)} "
                "blocks, the writer's runs hold another number",
            )
        blocks = expand_runs(runs)
        try:
            check_blocks(blocks, self.layout.num_blocks, "destination")
        except ValueError as exc:
            raise error(Code.BLOCK_OUT_OF_RANGE, str(exc)) from None
        if sorted(blocks) != sorted(transfer.dst_block_ids):
            raise error(
                Code.BLOCK_MISMATCH,
                f"transfer {transfer.transfer_id!r} expects blocks "
                f"{sorted(transfer.dst_block_ids)}, the writer sent {sorted(blocks)}",
            )
        return runs

    async def _run_transfer(self, conn: _Connection, seq: int, transfer: _Transfer) -> None:
        accept = {"op": "accept"}
        err: KVTransferError | None
        try:
            if not await conn.reply(seq, accept, self._frame_timeout_s):
                err = error(Code.PEER_GONE, f"writer of {transfer.transfer_id!r} went away")
            else:
                err = await self._wait_recvs(transfer)
            if err is not None:
                await self._fence(conn, transfer)
            self._finish(transfer, err)
        finally:
            conn.active -= 1
        if err is not None and err.code == Code.INTEGRITY:
            log.error("kv_integrity_failed", peer=conn.peer, transfer_id=transfer.transfer_id,
                      reason=err.message)
        reply = {"op": "done"} if err is None else {"op": "failed", "code": err.code}
        if err is not None:
            reply["message"] = err.message
        await conn.reply(seq, reply, self._frame_timeout_s)

    async def _wait_recvs(self, transfer: _Transfer) -> KVTransferError | None:
        """Every run landed and (with digests) matched its digest: None; else why not. A run
        is hashed as soon as it landed, in a thread, while the others still arrive."""
        loop = asyncio.get_running_loop()
        stop = asyncio.create_task(transfer.stop.wait())
        run_of = {task: index for index, task in enumerate(transfer.recvs)}
        pending: set[asyncio.Future[Any]] = set(transfer.recvs)
        try:
            while pending:
                remaining = transfer.deadline - loop.time()
                if remaining <= 0:
                    return error(
                        Code.TIMEOUT,
                        f"transfer {transfer.transfer_id!r} did not complete in time",
                    )
                done, pending = await asyncio.wait(
                    pending | {stop}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                if stop in done:
                    assert transfer.stop_reason is not None
                    return transfer.stop_reason
                pending.discard(stop)
                for task in done:
                    if task not in run_of:  # a digest check
                        mismatch = cast(KVTransferError | None, task.result())
                        if mismatch is not None:
                            return mismatch
                    elif (exc := task.exception()) is not None:
                        return error(
                            Code.PEER_GONE,
                            f"transfer {transfer.transfer_id!r}: receive failed: {exc!r}",
                        )
                    elif transfer.digests is not None:
                        check = asyncio.ensure_future(self._verify(transfer, run_of[task]))
                        check.add_done_callback(lambda f: f.cancelled() or f.exception())
                        pending.add(check)
            return None
        finally:
            stop.cancel()

    async def _verify(self, transfer: _Transfer, index: int) -> KVTransferError | None:
        assert transfer.digests is not None
        start, count = transfer.runs[index]
        buf = self._pool.run(start, count)
        if count * self.layout.block_nbytes <= INLINE_DIGEST_BYTES:
            got = digest(buf)  # cheaper than the hop to a thread
        else:
            got = await asyncio.to_thread(digest, buf)
        if got == transfer.digests[index]:
            return None
        return error(
            Code.INTEGRITY,
            f"transfer {transfer.transfer_id!r}: blocks {start}..{start + count - 1} do not "
            "match the digest the writer signed (altered in flight)",
        )

    async def _fence(self, conn: _Connection, transfer: _Transfer) -> None:
        pending = {t for t in transfer.recvs if not t.done()}
        if pending:
            _, pending = await asyncio.wait(pending, timeout=self._fence_grace_s)
        if pending:
            conn.abort(f"fencing transfer {transfer.transfer_id!r}", fencing=True)
            _, pending = await asyncio.wait(pending, timeout=self._fence_timeout_s)
        for task in transfer.recvs:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: failures here are expected after an abort
        if pending:
            transfer.fence_ok = False
            log.error("kv_fence_failed", transfer_id=transfer.transfer_id, pending=len(pending))

    def _pending_expired(self, transfer: _Transfer) -> None:
        if transfer.state is _State.PENDING:
            msg = f"transfer {transfer.transfer_id!r}: no writer arrived in time"
            self._finish(transfer, error(Code.TIMEOUT, msg))

    def _finish(self, transfer: _Transfer, err: KVTransferError | None) -> None:
        """Record the outcome. Callers guarantee the fence already holds."""
        if transfer.state in (_State.DONE, _State.FAILED):
            return
        transfer.state = _State.DONE if err is None else _State.FAILED
        if transfer.timer is not None:
            transfer.timer.cancel()
        self._transfers.pop(transfer.transfer_id, None)
        self._finished[transfer.transfer_id] = "done" if err is None else "failed"
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)
        if err is not None and not transfer.fence_ok:
            err.code = Code.FENCE_FAILED.value
        if not transfer.future.done():
            if err is None:
                transfer.future.set_result(transfer.notice)
            else:
                transfer.future.set_exception(err)
        transfer.fenced.set()
        log.debug("kv_transfer_finished", transfer_id=transfer.transfer_id, error=err and err.code)
