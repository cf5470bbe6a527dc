"""Decode side of a KV transfer: accept writes from prefill workers straight into the pool.

Lifecycle of one transfer, keyed by `transfer_id`:

    expect() -> PENDING --writer's request accepted--> ACTIVE --all bytes landed--> DONE
                   |                                   |  ^
                   |                  a part's bytes   |  |  the next part accepted
                   |                  landed           v  |
                   |                                  PARTIAL
                   |                                      |
                   +-- timeout / cancel() ----------------+--> FAILED (after the fence)

A transfer may come in parts (a write marked ``"part": true``): the prefill worker sends each
computed chunk while the next one computes. Only the last write (no ``part``; it carries the
notice) completes it, so a transfer whose last part never comes is never visible; a part that
fails fails the transfer. The parts come one at a time, from the writer of the first.

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
import functools
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import structlog
import torch

from kvxfer import listen
from kvxfer import shm as staging
from kvxfer.auth import MAC_FIELD, KVAuth
from kvxfer.inbound import (
    Connection,
    Expectation,
    Notice,
    State,
    Transfer,
    check_request,
    fence,
    wait_recvs,
)
from kvxfer.pool import DIGEST_HEX_CHARS, PoolBytes, check_blocks
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
)
from kvxfer.rings import StagingRings
from pdserve.ratelog import RateLimitedLog
from pdserve.types import KVLayout, KVTransferError

log = structlog.get_logger(__name__)

_FINISHED_MEMORY = 4096  # finished transfer ids remembered, for clearer late-writer errors
_FRAME_BASE_BYTES = 64 << 10  # a request's fixed part (ids, layout, notice) fits in this ...
_FRAME_BYTES_PER_BLOCK = 32 + DIGEST_HEX_CHARS + 3  # ... plus a run and its digest per block
_PEER_EVENTS = ("kv_bad_frame", "kv_connection_evicted", "kv_connection_refused",
                "kv_reply_failed", "kv_write_unauthenticated", "kv_write_rejected")
_REFUSED_LINGER_S = 0.5  # a refused peer's reject gets this long to be read before we hang up
_NONCE_MEMORY = 1 << 17  # signed frames remembered (within the clock skew) to refuse replays


class _Idle(Exception):
    """A connection sent nothing for longer than it may idle."""


class KVReceiver:
    """Accepts KV block writes into `pool` (a tensor laid out as `layout`) over UCX.

    `descriptor_id` names this pool incarnation (``"{worker_id}:{epoch}"``); writers that
    address another one are rejected. `host` is the address advertised in `address`; the UCX
    listener binds `bind_host` (default: `host`; "0.0.0.0" for every interface; see
    `kvxfer.listen`). With `auth`, only signed writes from authorized senders are served
    (`kvxfer.auth`). With `shm` (the default), a writer on the same host may move its bytes
    through a staging ring of `shm_slots` x `shm_slot_bytes` (`kvxfer.shm`; at most
    `max_shm_rings` at once, host-memory pools only), or, with `shm_cma` where the kernel
    lets us read the writer's memory, by a single copy (`kvxfer.cma`). Use as
    ``async with KVReceiver(...) as rx:``.
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
        shm: bool = True,
        shm_slots: int = staging.DEFAULT_SLOTS,
        shm_slot_bytes: int = staging.DEFAULT_SLOT_BYTES,
        max_shm_rings: int = 32,
        shm_cma: bool = True,
    ) -> None:
        self._pool = PoolBytes(pool, layout)
        self._rings = StagingRings(shm_slots, shm_slot_bytes, max_shm_rings, cma=shm_cma) \
            if shm and not self._pool.is_cuda and max_shm_rings > 0 else None
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
        self._transfers: dict[str, Transfer] = {}
        self._finished: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._conns: set[Connection] = set()
        self._unauthenticated: dict[Connection, None] = {}  # oldest first
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
        if self._rings is not None:
            self._rings.close()  # every transfer is fenced: no copy runs any more
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
        transfer = Transfer(transfer_id, blocks, loop.time() + timeout_s, fut)
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
        if transfer.state in (State.PENDING, State.PARTIAL):  # no byte is on its way
            self._finish(transfer, err)
        elif transfer.state is State.ACTIVE and transfer.stop_reason is None:
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
        conn = Connection(ep, peer=f"ep-{ep.uid:#x}",
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
                elif op in ("shm_open", "shm_attach"):
                    if not await self._on_shm(conn, seq, msg):
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
            if self._rings is not None:
                self._rings.release(conn)

    def _warn(self, event: str, key: str, **fields: Any) -> None:
        self._peer_logs[event](key, **fields)

    async def _next_frame(self, conn: Connection) -> dict[str, Any]:
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

    async def _authenticate(self, conn: Connection, seq: int, msg: dict[str, Any]) -> bool:
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

    async def _promote(self, conn: Connection, seq: int) -> bool:
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

    async def _on_write(self, conn: Connection, seq: int, msg: dict[str, Any]) -> bool:
        """Serve one write request; False if the connection must be dropped."""
        transfer_id = msg.get("transfer_id")
        if self._auth is not None and not await self._authenticate(conn, seq, msg):
            return False
        try:
            transfer, runs = self._admit(conn, msg)
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
        transfer.state = State.ACTIVE
        transfer.runs = runs
        transfer.recvs = []  # a part before this one received all of its own
        if transfer.timer is not None:
            transfer.timer.cancel()
        for index, (start, count) in enumerate([] if transfer.shm else runs):
            buf = self._pool.run(start, count)
            transfer.recvs.append(asyncio.create_task(conn.ep.recv(buf, tag=data_tag(seq, index))))
        conn.active += 1
        task = asyncio.create_task(self._run_transfer(conn, seq, transfer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def _admit(self, conn: Connection, msg: dict[str, Any]
               ) -> tuple[Transfer, list[tuple[int, int]]]:
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
        if transfer.state not in (State.PENDING, State.PARTIAL):
            raise error(Code.DUPLICATE_TRANSFER, f"transfer {transfer_id!r} already has a writer")
        try:
            runs = check_request(msg, transfer, self.layout,
                                 digests_required=self._auth is not None,
                                 shm_ok=conn.ring is not None or conn.cma_pid is not None)
        except KVTransferError as err:
            if err.code != Code.DUPLICATE_TRANSFER:  # not another writer's to end
                self._finish(transfer, err)
            raise
        return transfer, runs

    async def _run_transfer(self, conn: Connection, seq: int, transfer: Transfer) -> None:
        accept = {"op": "accept"}
        err: KVTransferError | None
        gone = error(Code.PEER_GONE, f"writer of {transfer.transfer_id!r} went away")
        try:
            if transfer.shm and self._rings is not None:  # fenced when it returns
                # Same host: start at once, while the accept goes out (the writer's first
                # chunk frame, or nothing with cma, can only follow it).
                accepted = asyncio.ensure_future(conn.reply(seq, accept, self._frame_timeout_s))
                err = await self._rings.receive(
                    conn, seq, transfer, self._pool,
                    None if self._auth is None else self._auth.key, transfer.src)
                if not await accepted:
                    err = err or gone
            elif not await conn.reply(seq, accept, self._frame_timeout_s):
                err = gone
            else:
                err = await wait_recvs(transfer, self._pool)
            if err is not None:
                await fence(conn, transfer, self._fence_grace_s, self._fence_timeout_s)
            if err is None and transfer.part:
                self._part_landed(transfer)
            else:
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

    async def _on_shm(self, conn: Connection, seq: int, msg: dict[str, Any]) -> bool:
        """``shm_open`` / ``shm_attach`` (kvxfer.shm); they authenticate the connection like a
        ping. False if the connection must be dropped."""
        if self._auth is not None:
            if not await self._authenticate(conn, seq, msg):
                return False
        elif not await self._promote(conn, seq):
            return False
        if msg["op"] == "shm_open":
            reply = self._rings.offer(conn, msg) if self._rings is not None \
                else {"op": "shm_refused", "reason": "no same-host path here (off, or CUDA)"}
        else:
            reply = self._rings.attach(conn, msg) if self._rings is not None \
                else {"op": "shm_refused", "reason": "no offer"}
        return await conn.reply(seq, reply, self._frame_timeout_s)

    def _part_landed(self, transfer: Transfer) -> None:
        """A part's bytes landed (fenced, digests matched): wait for the next part, until
        the transfer's deadline."""
        transfer.landed.update(block for start, count in transfer.runs
                               for block in range(start, start + count))
        transfer.state = State.PARTIAL
        loop = asyncio.get_running_loop()
        transfer.timer = loop.call_at(transfer.deadline, self._pending_expired, transfer)

    def _pending_expired(self, transfer: Transfer) -> None:
        if transfer.state in (State.PENDING, State.PARTIAL):
            what = "no writer arrived" if transfer.state is State.PENDING \
                else f"{len(transfer.landed)} blocks landed, the last part did not arrive"
            msg = f"transfer {transfer.transfer_id!r}: {what} in time"
            self._finish(transfer, error(Code.TIMEOUT, msg))

    def _finish(self, transfer: Transfer, err: KVTransferError | None) -> None:
        """Record the outcome. Callers guarantee the fence already holds."""
        if transfer.state in (State.DONE, State.FAILED):
            return
        transfer.state = State.DONE if err is None else State.FAILED
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
