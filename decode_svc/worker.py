"""The decode worker's domain logic, independent of gRPC.

Local requests are prefilled and decoded by the engine. Remote requests go through
allocate -> (prefill worker writes the KV over UCX) -> admit. The blocks of a remote request
are only freed once the KV receiver has fenced its transfer: a late write must never land in
a block that another request already reuses.

Blocks waiting for a transfer are bounded, whatever the callers ask for (a buggy or hostile
prefill side must not starve this worker's local requests): an allocation's lease and its wait
for the KV are capped by this worker's configuration, and allocations are refused
(CapacityError, so the router prefills locally) once `max_pending_kv_fraction` of the pool
waits for transfers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import cast

import structlog

from decode_svc.metrics import DecodeMetrics
from kvxfer.receiver import KVReceiver
from pdserve.control.load import WorkerLoad
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.metrics import engine_load
from pdserve.engine.stats import EngineStats
from pdserve.errors import (
    CapacityError,
    ErrorCode,
    InvalidRequestError,
    KVTransferError,
    PdserveError,
    RequestAbortedError,
)
from pdserve.handover import FirstToken
from pdserve.kv_layout import KVDestination
from pdserve.types import GenerateRequest, TokenEvent

log = structlog.get_logger(__name__)


@dataclass
class _Pending:
    slot: KVDestination
    expectation: asyncio.Future[dict] | object
    lease: asyncio.TimerHandle | None = None
    claimed: bool = False
    lease_s: float = 0.0  # the first lease on the blocks (renewed by parts that land) ...
    lease_end: float = 0.0  # ... ending then (loop.time())


class DecodeWorker:
    """`alloc_lease_s`: how long an unclaimed remote allocation is kept when the caller names
    no lease; `max_alloc_lease_s` caps the lease a caller names, `max_kv_wait_s` the time a
    claimed allocation waits for its KV; remote allocations may hold at most
    `max_pending_kv_fraction` of the KV pool until their KV lands."""

    def __init__(self, engine: AsyncEngine, receiver: KVReceiver, *, worker_id: str,
                 alloc_lease_s: float = 30.0, max_alloc_lease_s: float = 120.0,
                 max_kv_wait_s: float = 120.0, max_pending_kv_fraction: float = 0.5,
                 max_requests: int = 256, metrics: DecodeMetrics | None = None):
        if not 0 < alloc_lease_s <= max_alloc_lease_s or not max_kv_wait_s > 0:
            raise ValueError("need 0 < alloc_lease_s <= max_alloc_lease_s and max_kv_wait_s > 0")
        if not 0.0 < max_pending_kv_fraction <= 1.0:
            raise ValueError("max_pending_kv_fraction must be in (0, 1]")
        if max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        self.engine = engine
        self.receiver = receiver
        self.worker_id = worker_id
        self.max_requests = max_requests
        self.alloc_lease_s = alloc_lease_s
        self.max_alloc_lease_s = max_alloc_lease_s
        self.max_kv_wait_s = max_kv_wait_s
        self.max_pending_kv_blocks = max(1, int(engine.layout.num_blocks *
                                                max_pending_kv_fraction))
        self._reserving = 0  # blocks of allocations being made right now
        self._pending: dict[str, _Pending] = {}
        self._releasing: dict[str, asyncio.Task[None]] = {}
        self.active_streams = 0
        self.metrics = metrics if metrics is not None else DecodeMetrics()
        self.metrics.watch(worker_id, lambda: engine.last_stats,
                           lambda: self.active_streams, lambda: len(self._pending))

    @property
    def block_size(self) -> int:
        return self.engine.layout.block_size

    def load(self, stats: EngineStats | None = None) -> WorkerLoad:
        """The record published on every heartbeat and served by Stats (the engine's numbers
        included: `stats`, else its last snapshot)."""
        s = self.engine.last_stats if stats is None else stats
        return dataclasses.replace(WorkerLoad.from_dict(engine_load(s)), running=s.running,
                                   waiting=s.waiting, streams=self.active_streams)

    @property
    def num_requests(self) -> int:
        """Streams open here plus remote allocations no stream has claimed yet."""
        return self.active_streams + sum(1 for p in self._pending.values() if not p.claimed)

    def _admit(self) -> None:
        """The worker's own bound, whatever its callers do: past `max_requests` a new request
        is refused (UNAVAILABLE: the router places it elsewhere) instead of queueing."""
        if self.num_requests >= self.max_requests:
            self.metrics.refused.inc()
            raise CapacityError(f"decode worker {self.worker_id} holds {self.num_requests} "
                                f"requests, its limit", code=ErrorCode.WORKER_FULL)

    # ------------------------------------------------------------------ local prefill

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        self._admit()
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

    @property
    def pending_kv_blocks(self) -> int:
        """Blocks held by remote allocations whose KV has not landed (or being allocated)."""
        return self._reserving + sum(len(p.slot.block_ids)
                                     for p in self._pending.values())

    async def allocate_remote(self, req: GenerateRequest, lease_s: float | None = None, *,
                              renew_until_s: float | None = None) -> KVDestination:
        """Reserve blocks for `req`'s KV. The lease is `lease_s` (None or 0: the default),
        at most `max_alloc_lease_s`; with `renew_until_s`, each part of the KV that lands
        renews it, up to that long after now (at most `max_kv_wait_s`). CapacityError when
        the blocks cannot be had now."""
        self._admit()
        need = -(-len(req.token_ids) // self.block_size)
        if self.pending_kv_blocks + need > self.max_pending_kv_blocks:
            raise CapacityError(
                f"{self.pending_kv_blocks} KV blocks already wait for transfers; another "
                f"{need} would pass this worker's limit of {self.max_pending_kv_blocks}",
                code=ErrorCode.KV_PENDING_LIMIT)
        self._reserving += need
        try:
            alloc = await self.engine.allocate_remote(req)
        finally:
            self._reserving -= need
        transfer_id = f"{req.request_id}/{uuid.uuid4().hex[:12]}"
        skip = alloc.num_cached_tokens // self.block_size
        lease = min(lease_s or self.alloc_lease_s, self.max_alloc_lease_s)
        try:
            renew_until = None if renew_until_s is None else \
                max(lease, min(renew_until_s, self.max_kv_wait_s))
            expectation = self.receiver.expect(transfer_id, alloc.block_ids[skip:], lease,
                                               max_s=renew_until)
        except BaseException:
            await self.engine.abort(req.request_id)
            raise
        slot = KVDestination(alloc.request_id, alloc.block_ids, alloc.num_cached_tokens,
                             self.receiver.descriptor_id, transfer_id, self.engine.layout)
        loop = asyncio.get_running_loop()
        pending = _Pending(slot, expectation, lease_s=lease, lease_end=loop.time() + lease)
        pending.lease = loop.call_later(lease, self._lease_expired, req.request_id)
        self._pending[req.request_id] = pending
        return slot

    def _lease_expired(self, request_id: str) -> None:
        p = self._pending.get(request_id)
        if p is not None and not p.claimed:
            log.warning("remote_allocation_unclaimed", request_id=request_id)
            self._release_soon(request_id, "allocation lease expired")

    async def generate_remote(self, request_id: str, transfer_id: str, *,
                              timeout_s: float = 30.0) -> AsyncIterator[TokenEvent]:
        """Wait for the request's KV to land (at most `timeout_s`, capped by `max_kv_wait_s`),
        then decode it in the running batch.

        The first token (with its logprob) comes in the transfer's completion notice
        (`pdserve.handover.FirstToken`), so decoding starts the moment the KV is in place.
        """
        timeout_s = min(timeout_s, self.max_kv_wait_s)
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
            except TimeoutError as exc:
                raise KVTransferError(
                    f"KV for {request_id!r} did not arrive within {timeout_s:.1f}s",
                    code=ErrorCode.KV_TIMEOUT) from exc
            first = FirstToken.from_notice(notice)
            if request_id in self._releasing:  # aborted while the KV was landing
                raise RequestAbortedError(f"request {request_id!r} was aborted")
            if p.lease is not None:
                p.lease.cancel()
            self._pending.pop(request_id, None)
            admitted = True
            waited = time.monotonic() - t0
            self.metrics.kv_wait.labels("landed").observe(waited)
            if (past := asyncio.get_running_loop().time() - p.lease_end) > 0:
                # Kept by the renewals its landed parts gave: without them the worker would
                # have dropped this prefill, and the router prefilled it again here.
                self.metrics.kv_landed_past_lease.inc()
                log.info("remote_kv_landed_past_lease", request_id=request_id,
                         lease_s=round(p.lease_s, 3), past_lease_s=round(past, 3))
            counted = False
            log.debug("remote_kv_ready", request_id=request_id, wait_ms=round(waited * 1000, 2))
            async with contextlib.aclosing(_agen(
                    self.engine.admit_remote(request_id, first.token_id, first.logprob))
            ) as events:
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

    async def allocate_and_generate(self, req: GenerateRequest, *, lease_s: float | None = None,
                                    timeout_s: float = 30.0
                                    ) -> AsyncGenerator[KVDestination | TokenEvent, None]:
        """A remote prefill in one stream: first the allocation (`allocate_remote`: where the
        prefill worker writes, to be handed on), then the request's events (`generate_remote`:
        from the KV's arrival on, at most `timeout_s` after the allocation). The lease is
        renewed by each part of the KV that lands, within `timeout_s`. However the consumer
        leaves, the allocation is fenced and freed unless the request was admitted (then
        closing the stream aborts it, as for `generate`)."""
        slot = await self.allocate_remote(req, lease_s, renew_until_s=timeout_s)
        try:
            yield slot
        except BaseException:  # closed or cancelled before the claim: nothing else frees it
            self._release_soon(req.request_id, "remote stream closed before its KV wait")
            raise
        # generate_remote claims the allocation on its first step, i.e. right away.
        async with contextlib.aclosing(_agen(self.generate_remote(
                req.request_id, slot.transfer_id, timeout_s=timeout_s))) as events:
            async for ev in events:
                yield ev

    def _finished(self, kind: str, outcome: str, last: TokenEvent | None) -> None:
        """Count a request that ended and log one line about it (never its text); the
        request id comes from the RPC's log context."""
        self.metrics.requests.labels(kind, outcome).inc()
        log.info("decode_request_finished", kind=kind, outcome=outcome,
                 prompt_tokens=last.num_prompt_tokens if last else None,
                 cached_tokens=last.num_cached_tokens if last else None,
                 output_tokens=last.num_output_tokens if last else 0)

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
            return
        if p.lease is not None:
            p.lease.cancel()
        blocks = len(p.slot.block_ids)
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


def _agen(events: AsyncIterator[TokenEvent]) -> AsyncGenerator[TokenEvent, None]:
    """AsyncEngine's streams are async generators typed as iterators; aclosing needs aclose."""
    return cast(AsyncGenerator[TokenEvent, None], events)


__all__ = ["DecodeWorker", "PdserveError"]
