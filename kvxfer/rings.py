"""Setting up the same-host paths: a single copy by cross-memory attach (kvxfer.cma) where
the kernel allows it, else a staging ring (kvxfer.shm). The decode side's `StagingRings`
answers a writer connection that asks from this host; the prefill side's `open_ring` asks."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from kvxfer import cma
from kvxfer.cma import lanes as cma_lanes
from kvxfer.inbound import Connection, Transfer
from kvxfer.pool import PoolBytes
from kvxfer.protocol import error
from kvxfer.shm import Ring, SenderRing, chunks, receive_chunks
from pdserve.control.workers import boot_id as host_id  # equal ends: the same host
from pdserve.errors import ErrorCode, KVTransferError

log = structlog.get_logger(__name__)


async def open_ring(exchange: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
                    host: str, probe: cma.Probe) -> SenderRing | bool:
    """Ask the receiver for a staging ring over `exchange` (one signed request, its reply)
    and map it: True where the receiver reads our blocks itself (kvxfer.cma), False where it
    is not on this host or the ring cannot be opened (UCX carries the data). Raises
    KVTransferError where the receiver refuses the connection itself."""
    offer = await exchange({"op": "shm_open", "host": host, **probe.offer()})
    if offer.get("op") == "reject":  # the connection itself is refused (not signed, full)
        raise KVTransferError(f"receiver refused the connection: {offer.get('message', '')}",
                              code=str(offer.get("code", ErrorCode.KV_PROTOCOL_ERROR)))
    if offer.get("op") != "shm_offer":
        log.info("kv_shm_unavailable", reason=str(offer.get("reason"))[:200])
        return False
    if offer.get("cma") is True:
        return True
    try:
        ring: Ring | None = Ring.attach(offer.get("name"), offer.get("token"),  # type: ignore[arg-type]
                                        offer.get("slots"), offer.get("slot_bytes"))  # type: ignore[arg-type]
        answer = {"op": "shm_attach", "ok": True, "token": offer.get("token")}
    except (OSError, ValueError, TypeError) as exc:
        ring = None
        answer = {"op": "shm_attach", "ok": False, "reason": repr(exc)[:200]}
        log.info("kv_shm_unavailable", reason=repr(exc)[:200])
    attached = await exchange(answer)
    if ring is None or attached.get("op") != "shm_attached" or attached.get("ok") is not True:
        return False
    return SenderRing(ring)


class StagingRings:
    """The decode side's rings: one per connection that asked from this host, at most
    `max_rings`, and one copy thread for all of them."""

    def __init__(self, slots: int, slot_bytes: int, max_rings: int, *, cma: bool = True
                 ) -> None:
        self.slots, self.slot_bytes, self.max_rings = slots, slot_bytes, max_rings
        self.cma = cma  # try a single copy by cross-memory attach first
        self.host = host_id()
        self.count = 0  # offered or attached
        self._copier: ThreadPoolExecutor | None = None
        self._cma_copier: ThreadPoolExecutor | None = None
        self._cma_lanes = cma_lanes()

    def offer(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        """The reply to ``shm_open``: a new ring's name and token, or why not."""
        if self.host is None or msg.get("host") != self.host:
            why = "another host"
        elif conn.ring is not None or conn.offer is not None or conn.cma_pid is not None \
                or conn.active:
            why = "this connection has a same-host path, or transfers running"
        elif self.cma and (pid := cma.reachable(msg)) is not None:
            conn.cma_pid = pid
            log.info("kv_shm_cma", peer=conn.peer, pid=pid)
            return {"op": "shm_offer", "cma": True}
        elif self.count >= self.max_rings:
            why = f"this receiver serves {self.max_rings} rings"
        else:
            try:
                ring = Ring.create(self.slots, self.slot_bytes)
            except (OSError, ValueError) as exc:
                log.warning("kv_shm_ring_failed", error=repr(exc))
                return {"op": "shm_refused", "reason": "cannot create a ring here"}
            conn.offer = ring  # not usable until attached
            self.count += 1
            return {"op": "shm_offer", "name": ring.path.name, "token": ring.token.hex(),
                    "slots": ring.slots, "slot_bytes": ring.slot_bytes}
        return {"op": "shm_refused", "reason": why}

    def attach(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        """The reply to ``shm_attach``: the writer mapped the offered ring (or could not)."""
        ring, conn.offer = conn.offer, None
        if ring is None:
            return {"op": "shm_refused", "reason": "no offer"}
        ring.unlink()  # mapped on both ends (or given up): the name is not needed any more
        if msg.get("ok") is True and msg.get("token") == ring.token.hex():
            conn.ring = ring
            log.info("kv_shm_ring_attached", peer=conn.peer, slots=ring.slots,
                     slot_bytes=ring.slot_bytes)
        else:
            self.count -= 1
            log.info("kv_shm_ring_declined", peer=conn.peer, reason=str(msg.get("reason"))[:200])
        return {"op": "shm_attached", "ok": conn.ring is not None}

    def release(self, conn: Connection) -> None:
        """The connection ended: its ring goes (its memory with the last view of it)."""
        for ring in (conn.offer, conn.ring):
            if ring is not None:
                ring.unlink()
                self.count -= 1
        conn.offer = conn.ring = None

    async def receive(self, conn: Connection, seq: int, transfer: Transfer, pool: PoolBytes,
                      key: bytes | None, src: Any) -> KVTransferError | None:
        """`receive_chunks` for an accepted staging-ring write: fenced when it returns."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="kv-shm-copy")
        block = pool.layout.block_nbytes
        if conn.cma_pid is not None:
            try:
                work = cma.pieces([(start * block, count * block)
                                   for start, count in transfer.runs], src, cma.PIECE_BYTES)
            except ValueError as exc:
                return error(ErrorCode.KV_PROTOCOL_ERROR,
                             f"transfer {transfer.transfer_id!r}: {exc}")
            if self._cma_copier is None:
                self._cma_copier = ThreadPoolExecutor(2 * self._cma_lanes,
                                                      thread_name_prefix="kv-cma-copy")
            return await cma.receive(conn.cma_pid, pool.tensor.data_ptr(), work,
                                     transfer.transfer_id, self._cma_copier, transfer.stop,
                                     lambda: transfer.stop_reason, transfer.deadline,
                                     parallel=self._cma_lanes)
        ring = conn.ring
        if ring is None:  # the connection closed meanwhile
            return error(ErrorCode.KV_PEER_GONE, f"writer of {transfer.transfer_id!r} went away")
        segments = chunks([(start * block, count * block) for start, count in transfer.runs],
                          ring.slot_bytes)

        return await receive_chunks(conn.ep, seq, ring, pool.flat(), segments,
                                    transfer.transfer_id, key, self._copier, transfer.stop,
                                    lambda: transfer.stop_reason, transfer.deadline)

    def close(self) -> None:
        for copier in (self._copier, self._cma_copier):
            if copier is not None:
                copier.shutdown(wait=False)
