"""The decode worker's domain logic, independent of gRPC.

Local requests are prefilled and decoded by the engine. Remote requests go through
allocate -> (prefill worker writes the KV over UCX) -> admit. The blocks of a remote request
are only freed once the KV receiver has fenced its transfer: a late write must never land in
a block that another request already reuses.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog

from engine.async_engine import AsyncEngine
from engine.llm_engine import RemoteAllocation
from engine.types import (
    GenerateRequest,
    InvalidRequestError,
    KVTransferError,
    PdserveError,
    TokenEvent,
    TokenLogprob,
)
from kvxfer.receiver import KVReceiver

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RemoteSlot:
    """What a prefill worker needs to write a request's KV here."""

    allocation: RemoteAllocation
    transfer_id: str
    descriptor_id: str


@dataclass
class _Pending:
    slot: RemoteSlot
    expectation: asyncio.Future[dict] | object
    lease: asyncio.TimerHandle | None = None
    claimed: bool = False


class DecodeWorker:
    def __init__(self, engine: AsyncEngine, receiver: KVReceiver, *, worker_id: str,
                 alloc_lease_s: float = 30.0):
        self.engine = engine
        self.receiver = receiver
        self.worker_id = worker_id
        self.alloc_lease_s = alloc_lease_s
        self._pending: dict[str, _Pending] = {}
        self._releasing: dict[str, asyncio.Task[None]] = {}
        self.active_streams = 0

    @property
    def block_size(self) -> int:
        return self.engine.layout.block_size

    def load(self) -> dict[str, float]:
        s = self.engine.last_stats
        return {"running": s.running, "waiting": s.waiting, "awaiting_kv": s.awaiting_kv,
                "free_blocks": s.free_blocks, "total_blocks": s.total_blocks,
                "streams": self.active_streams}

    # ------------------------------------------------------------------ local prefill

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        self.active_streams += 1
        try:
            async for ev in self.engine.generate(req):
                yield ev
        finally:
            self.active_streams -= 1

    # ------------------------------------------------------------------ remote prefill

    async def allocate_remote(self, req: GenerateRequest, lease_s: float | None = None
                              ) -> RemoteSlot:
        alloc = await self.engine.allocate_remote(req)
        transfer_id = f"{req.request_id}/{uuid.uuid4().hex[:12]}"
        skip = alloc.num_cached_tokens // self.block_size
        lease = lease_s or self.alloc_lease_s
        try:
            expectation = self.receiver.expect(transfer_id, alloc.block_ids[skip:], lease)
        except BaseException:
            await self.engine.abort(req.request_id)
            raise
        slot = RemoteSlot(alloc, transfer_id, self.receiver.descriptor_id)
        pending = _Pending(slot, expectation)
        loop = asyncio.get_running_loop()
        pending.lease = loop.call_later(lease, self._lease_expired, req.request_id)
        self._pending[req.request_id] = pending
        return slot

    def _lease_expired(self, request_id: str) -> None:
        p = self._pending.get(request_id)
        if p is not None and not p.claimed:
            log.warning("remote_allocation_unclaimed", request_id=request_id)
            self._release_soon(request_id, "allocation lease expired")

    async def generate_remote(self, request_id: str, transfer_id: str, *,
                              first_token: int | None = None,
                              first_logprob: TokenLogprob | None = None,
                              timeout_s: float = 30.0) -> AsyncIterator[TokenEvent]:
        """Wait for the request's KV to land, then decode it in the running batch.

        The first token comes from the caller or, when it has none, from the transfer's
        completion notice, so decoding starts the moment the KV is in place.
        """
        p = self._pending.get(request_id)
        if p is None or p.slot.transfer_id != transfer_id:
            raise InvalidRequestError(f"no remote allocation {transfer_id!r} for request "
                                      f"{request_id!r} on {self.worker_id}")
        if p.claimed:
            raise InvalidRequestError(f"request {request_id!r} is already being generated")
        p.claimed = True
        self.active_streams += 1
        admitted = False
        try:
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(timeout_s):
                    notice = await p.expectation  # type: ignore[misc]
            except TimeoutError:
                raise KVTransferError(
                    f"KV for {request_id!r} did not arrive within {timeout_s:.1f}s",
                    code="kv_timeout") from None
            notice = notice or {}
            if first_token is None:
                if "first_token" not in notice:
                    raise KVTransferError("transfer completed without a first token",
                                          code="kv_protocol")
                first_token = int(notice["first_token"])
                if first_logprob is None and notice.get("logprob") is not None:
                    first_logprob = TokenLogprob(first_token, float(notice["logprob"]))
            if p.lease is not None:
                p.lease.cancel()
            self._pending.pop(request_id, None)
            admitted = True
            log.debug("remote_kv_ready", request_id=request_id,
                      wait_ms=round((time.monotonic() - t0) * 1000, 2))
            async for ev in self.engine.admit_remote(request_id, first_token, first_logprob):
                yield ev
        finally:
            self.active_streams -= 1
            if not admitted:
                # Cancelled, timed out or failed before admission: fence, then free.
                self._release_soon(request_id, "remote generation ended early")

    def _release_soon(self, request_id: str, reason: str) -> asyncio.Task[None] | None:
        """Fence and free a pending remote request, once; callers may await the task."""
        task = self._releasing.get(request_id)
        if task is None and request_id in self._pending:
            task = asyncio.get_running_loop().create_task(self._release(request_id, reason))
            self._releasing[request_id] = task
            task.add_done_callback(lambda _: self._releasing.pop(request_id, None))
        return task

    async def _release(self, request_id: str, reason: str) -> None:
        p = self._pending.pop(request_id)
        if p.lease is not None:
            p.lease.cancel()
        try:
            await self.receiver.cancel(p.slot.transfer_id, reason=reason)
        except KVTransferError:
            # UCX never confirmed the receives ended: those blocks may still be written.
            # Leaking them is the only safe choice.
            log.error("kv_fence_failed_blocks_quarantined", request_id=request_id,
                      blocks=len(p.slot.allocation.block_ids))
            return
        await self.engine.abort(request_id)

    async def abort(self, request_id: str) -> bool:
        """End a request in any state; returns once its blocks are fenced and freed."""
        task = self._release_soon(request_id, "aborted")
        if task is not None:
            await asyncio.shield(task)
            return True
        await self.engine.abort(request_id)
        return True

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no stream or pending remote request is left (or the timeout)."""
        deadline = time.monotonic() + timeout_s
        while self.active_streams or self._pending:
            if time.monotonic() > deadline:
                log.warning("drain_timeout", streams=self.active_streams,
                            pending=len(self._pending))
                return False
            await asyncio.sleep(0.05)
        return True

    async def cached_prefix(self, token_ids: list[int]) -> int:
        return await self.engine.num_cached_tokens(token_ids)

    async def close(self) -> None:
        for rid in list(self._pending):
            self._release_soon(rid, "worker shutting down")
        if self._releasing:
            await asyncio.wait(list(self._releasing.values()), timeout=15)


__all__ = ["DecodeWorker", "PdserveError", "RemoteSlot"]
