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
fails fails the transfer. The parts come one at a time, from the writer of the first. A part
that lands renews the transfer's timeout (a writer that keeps making progress is not cut off
at a deadline sized for a guess), up to the transfer's `max_s`.

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

This module serves each connection's requests and runs the writes it accepts. The pieces it
uses: which connections are served and for how long (unauthenticated ones bounded and
evicted, authenticated ones idling up to `idle_timeout_s`, replays refused) is
`kvxfer.connections`; the table of transfers and their state machine, `kvxfer.transfers`; a
write's validation, posted receives, digest checks and fence, `kvxfer.inbound`; the
same-host paths, `kvxfer.rings`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import structlog
import torch

from kvxfer import listen
from kvxfer import shm as staging
from kvxfer.auth import MAC_FIELD, KVAuth
from kvxfer.connections import ConnectionGate, Idle
from kvxfer.inbound import Connection, Expectation, Transfer, fence, wait_recvs
from kvxfer.pool import PoolBytes
from kvxfer.protocol import SEQ_LIMIT, ProtocolError, UCXError, data_tag, error
from kvxfer.rings import StagingRings
from kvxfer.transfers import TransferTable
from pdserve.aio import AsyncResource
from pdserve.errors import ErrorCode, KVTransferError
from pdserve.kv_layout import KVLayout
from pdserve.ratelog import RateLimitedLog

__all__ = ["Expectation", "KVReceiver"]

log = structlog.get_logger(__name__)


class KVReceiver(AsyncResource):
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
        self._gate = ConnectionGate(
            auth, layout.num_blocks, frame_timeout_s=frame_timeout_s,
            idle_timeout_s=idle_timeout_s, max_connections=max_connections,
            max_unauthenticated=max_unauthenticated, log_interval_s=log_interval_s)
        self._table = TransferTable(layout, fence_grace_s=fence_grace_s,
                                    fence_timeout_s=fence_timeout_s)
        self._listener: Any = None
        self._bound_port: int | None = None
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # The gate's and the table's state under the names tests inspect.

    @property
    def _conns(self) -> set[Connection]:
        return self._gate.conns

    @property
    def _unauthenticated(self) -> dict[Connection, None]:
        return self._gate.unauthenticated

    @property
    def _peer_logs(self) -> dict[str, RateLimitedLog]:
        return self._gate.peer_logs

    @property
    def _max_frame_bytes(self) -> int:
        return self._gate.max_frame_bytes

    @property
    def _transfers(self) -> dict[str, Transfer]:
        return self._table.transfers

    # ------------------------------------------------------------------ lifecycle


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
        self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float, *,
        max_s: float | None = None
    ) -> Expectation:
        """Allow one writer to fill `dst_block_ids`: its first part (or its whole write)
        within `timeout_s`, each later part within `timeout_s` of the one before, all of it
        within `max_s` (None: `timeout_s`, i.e. no renewal).

        The writer must send exactly these blocks (in any order). Raises KVTransferError with
        code ``kv_invalid_argument`` for an empty, duplicated or out-of-range id list or a
        transfer id already in use, or `max_s` < `timeout_s`.
        """
        if self._closing:
            raise error(ErrorCode.KV_CLOSED, "receiver is closed")
        return self._table.expect(transfer_id, dst_block_ids, timeout_s, max_s=max_s)

    async def cancel(self, transfer_id: str, *, reason: str = "cancelled") -> None:
        """Abort a transfer; returns once no byte can land in its blocks any more.

        Only after this returns may the caller free the blocks. A no-op for unknown or
        finished transfers (they are already fenced). Raises KVTransferError with code
        ``kv_fence_failed`` if UCX never confirmed the cancellation: keep those blocks out
        of use.
        """
        await self._table.cancel(transfer_id, reason=reason)

    # ------------------------------------------------------------------ serving writers

    async def _serve(self, ep: Any) -> None:
        """One connected sender: read requests until the endpoint goes away or idles too long
        (see kvxfer.connections for what an unauthenticated connection may do)."""
        conn = self._gate.connection(ep)
        if self._closing:
            conn.abort("receiver closed")
            return
        self._gate.admit(conn)
        serving = asyncio.current_task()
        if serving is not None:
            self._tasks.add(serving)
        try:
            while not self._closing and not conn.ep.closed:
                try:
                    msg = await self._gate.next_frame(conn)
                except Idle:
                    break
                except (ProtocolError, TimeoutError) as exc:
                    self._gate.warn("kv_bad_frame", "frame", peer=conn.peer,
                                    error=str(exc) or "timeout")
                    break
                except UCXError:
                    break  # the sender closed or died, or we evicted it
                op, seq = msg.get("op"), msg.get("seq")
                if isinstance(seq, bool) or not isinstance(seq, int) or not 0 < seq < SEQ_LIMIT:
                    self._gate.warn("kv_bad_frame", "frame", peer=conn.peer,
                                    error=f"bad seq {seq!r:.40}")
                    break
                if op == "ping":
                    if MAC_FIELD in msg and not await self._gate.authenticate(conn, seq, msg):
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
                        "code": ErrorCode.KV_PROTOCOL_ERROR,
                        "message": f"bad op {op!r:.40}",
                    }
                    await conn.reply(seq, reject, self._frame_timeout_s)
                    if not conn.authenticated:
                        break
        finally:
            self._gate.leave(conn)
            self._tasks.discard(serving)
            conn.abort("connection closed")
            if self._rings is not None:
                self._rings.release(conn)

    async def _on_write(self, conn: Connection, seq: int, msg: dict[str, Any]) -> bool:
        """Serve one write request; False if the connection must be dropped."""
        transfer_id = msg.get("transfer_id")
        if self._auth is not None and not await self._gate.authenticate(conn, seq, msg):
            return False
        try:
            transfer, runs = self._admit(conn, msg)
        except KVTransferError as err:
            self._gate.warn("kv_write_rejected", err.code, peer=conn.peer,
                            transfer_id=str(transfer_id)[:80], code=err.code,
                            reason=err.message)
            reject = {"op": "reject", "code": err.code, "message": err.message}
            await conn.reply(seq, reject, self._frame_timeout_s)
            return True
        if not await self._gate.promote(conn, seq):  # only without `auth`; the transfer
            return False  # stays expected, as after any refused write
        # Accepted: from here on the writer may move bytes into the blocks.
        self._table.accepted(transfer, runs)
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
        """Validate a write request (`TransferTable.take`, which may fail the transfer it
        names); raises KVTransferError (sent back as a reject)."""
        descriptor_id = msg.get("descriptor_id")
        if descriptor_id != self.descriptor_id:
            raise error(
                ErrorCode.KV_STALE_DESCRIPTOR,
                f"descriptor {descriptor_id!r} does not name this KV pool (now "
                f"{self.descriptor_id!r}); the decode worker restarted or the descriptor is "
                "forged. Look the descriptor up again.",
            )
        return self._table.take(msg, digests_required=self._auth is not None,
                                shm_ok=conn.ring is not None or conn.cma_pid is not None)

    async def _run_transfer(self, conn: Connection, seq: int, transfer: Transfer) -> None:
        accept = {"op": "accept"}
        err: KVTransferError | None
        gone = error(ErrorCode.KV_PEER_GONE, f"writer of {transfer.transfer_id!r} went away")
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
                self._table.part_landed(transfer)
            else:
                self._table.finish(transfer, err)
        finally:
            conn.active -= 1
        if err is not None and err.code == ErrorCode.KV_INTEGRITY_FAILED:
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
            if not await self._gate.authenticate(conn, seq, msg):
                return False
        elif not await self._gate.promote(conn, seq):
            return False
        if msg["op"] == "shm_open":
            reply = self._rings.offer(conn, msg) if self._rings is not None \
                else {"op": "shm_refused", "reason": "no same-host path here (off, or CUDA)"}
        else:
            reply = self._rings.attach(conn, msg) if self._rings is not None \
                else {"op": "shm_refused", "reason": "no offer"}
        return await conn.reply(seq, reply, self._frame_timeout_s)
