"""The decode worker's domain logic, independent of gRPC.

Local requests are prefilled and decoded by the engine. Remote requests go through
allocate -> (prefill worker writes the KV over UCX) -> admit. The blocks of a remote request
are only freed once the KV receiver has fenced its transfer: a late write must never land in
a block that another request already reuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import cast

import structlog

from decode_svc.metrics import DecodeMetrics
from engine.async_engine import AsyncEngine
from engine.llm_engine import RemoteAllocation
from engine.types import (
    GenerateRequest,
    InvalidRequestError,
    KVTransferError,
    PdserveError,
    RequestAbortedError,
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
                 alloc_lease_s: float = 30.0, metrics: DecodeMetrics | None = None):
        self.engine = engine
        self.receiver = receiver
        self.worker_id = worker_id
        self.alloc_lease_s = alloc_lease_s
        self._pending: dict[str, _Pending] = {}
        self._releasing: dict[str, asyncio.Task[None]] = {}
        self.active_streams = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics = metrics if metrics is not None else DecodeMetrics()
        self.metrics.watch(worker_id, lambda: engine.last_stats,
                           lambda: self.active_streams, lambda: len(self._pending))

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
        outcome, last = "cancelled", None
        try:
            # aclosing: a consumer that leaves aborts the engine request right away.
            async with contextlib.aclosing(_agen(self.engine.generate(req))) as events:
                async for ev in events:
                    last = ev
                    if ev.finish_reason is not None:
                        outcome = ev.finish_reason.value
                    yield ev
        except Exception:
            outcome = "failed"
            raise
        finally:
            self.active_streams -= 1
            self._finished("local", outcome, last)

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
        outcome, last = "cancelled", None
        t0 = time.monotonic()
        try:
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
            if request_id in self._releasing:  # aborted while the KV was landing
                raise RequestAbortedError(f"request {request_id!r} was aborted")
            if p.lease is not None:
                p.lease.cancel()
            self._pending.pop(request_id, None)
            admitted = True
            waited = time.monotonic() - t0
            self.metrics.kv_wait.labels("landed").observe(waited)
            counted = False
            log.debug("remote_kv_ready", request_id=request_id, wait_ms=round(waited * 1000, 2))
            async with contextlib.aclosing(_agen(
                    self.engine.admit_remote(request_id, first_token, first_logprob))) as events:
                async for ev in events:
                    if not counted:  # the first event means the engine took the request
                        counted = True
                        self.metrics.remote_admissions.inc()
                    last = ev
                    if ev.finish_reason is not None:
                        outcome = ev.finish_reason.value
                    yield ev
        except Exception:
            outcome = "failed"
            raise
        finally:
            self.active_streams -= 1
            self._finished("remote", outcome, last)
            if not admitted:
                self.metrics.kv_wait.labels(outcome).observe(time.monotonic() - t0)
                # Cancelled, timed out or failed before admission: fence, then free.
                self._release_soon(request_id, "remote generation ended early")

    def _finished(self, kind: str, outcome: str, last: TokenEvent | None) -> None:
        """Count a request that ended and log one line about it (never its text); the
        request id comes from the RPC's log context."""
        self.metrics.requests.labels(kind, outcome).inc()
        if outcome in ("cancelled", "failed"):
            self._refresh_stats_soon()
        log.info("decode_request_finished", kind=kind, outcome=outcome,
                 prompt_tokens=last.num_prompt_tokens if last else None,
                 cached_tokens=last.num_cached_tokens if last else None,
                 output_tokens=last.num_output_tokens if last else 0)

    def _refresh_stats_soon(self) -> None:
        """AsyncEngine refreshes `last_stats` only after a step, but aborts run between steps:
        without this, the load we report (and the gauges) would show an aborted request's
        blocks in use until the next step. Queued after the abort, so it sees its effect."""
        task = asyncio.get_running_loop().create_task(self._refresh_stats())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refresh_stats(self) -> None:
        with contextlib.suppress(PdserveError):  # the engine is closing
            self.engine.last_stats = await self.engine.stats()

    def _release_soon(self, request_id: str, reason: str) -> asyncio.Task[None] | None:
        """Fence and free a pending remote request, once; callers may await the task."""
        task = self._releasing.get(request_id)
        if task is None and request_id in self._pending:
            task = asyncio.get_running_loop().create_task(self._release(request_id, reason))
            self._releasing[request_id] = task
            task.add_done_callback(lambda _: self._releasing.pop(request_id, None))
        return task

    async def _release(self, request_id: str, reason: str) -> None:
        p = self._pending.pop(request_id, None)
        if p is None:  # admitted since this task was created: a plain abort frees it
            await self.engine.abort(request_id)
            await self._refresh_stats()
            return
        if p.lease is not None:
            p.lease.cancel()
        blocks = len(p.slot.allocation.block_ids)
        try:
            await self.receiver.cancel(p.slot.transfer_id, reason=reason)
        except KVTransferError:
            # UCX never confirmed the receives ended: those blocks may still be written.
            # Leaking them is the only safe choice.
            self.metrics.quarantined_blocks.inc(blocks)
            log.error("kv_fence_failed_blocks_quarantined", request_id=request_id,
                      blocks=blocks)
            return
        self.metrics.fenced_transfers.inc()
        self.metrics.fenced_blocks.inc(blocks)
        await self.engine.abort(request_id)
        await self._refresh_stats()

    async def abort(self, request_id: str) -> bool:
        """End a request in any state; returns once its blocks are fenced and freed."""
        task = self._release_soon(request_id, "aborted")
        if task is not None:
            await asyncio.shield(task)
            return True
        await self.engine.abort(request_id)
        await self._refresh_stats()
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


def _agen(events: AsyncIterator[TokenEvent]) -> AsyncGenerator[TokenEvent, None]:
    """AsyncEngine's streams are async generators typed as iterators; aclosing needs aclose."""
    return cast(AsyncGenerator[TokenEvent, None], events)


__all__ = ["DecodeWorker", "PdserveError", "RemoteSlot"]
