"""The prefill worker's domain logic, independent of gRPC."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog

from kvxfer.sender import KVSender
from pdserve.control.load import WorkerLoad
from pdserve.engine.async_engine import AsyncEngine, PrefillResult
from pdserve.engine.metrics import engine_load
from pdserve.engine.stats import EngineStats
from pdserve.errors import (
    CapacityError,
    EngineClosedError,
    ErrorCode,
    InvalidRequestError,
    KVTransferError,
)
from pdserve.handover import FirstToken
from pdserve.kv_layout import KVDestination
from pdserve.types import GenerateRequest, LatencyClass, PrefillReport
from prefill_svc.gate import PriorityGate
from prefill_svc.metrics import PrefillMetrics
from prefill_svc.parts import PartSender

log = structlog.get_logger(__name__)


class PrefillWorker:
    def __init__(self, engine: AsyncEngine, sender: KVSender, *, worker_id: str,
                 max_inflight: int = 4, transfer_timeout_s: float = 30.0,
                 max_requests: int = 256, metrics: PrefillMetrics | None = None,
                 overlap: bool = True):
        self.engine = engine
        self.sender = sender
        self.worker_id = worker_id
        self.gate = PriorityGate(max_inflight)
        if max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        self.max_requests = max_requests  # queued + computing + transferring, at most
        self.transfer_timeout_s = transfer_timeout_s
        self.overlap = overlap  # send each computed chunk's KV while the next one computes
        self.accepting = True
        self.inflight = 0
        self._freeing: set[asyncio.Future[None]] = set()  # blocks being freed (`_free`)
        self.queued_by_class: dict[str, int] = {c.value: 0 for c in LatencyClass}
        self.metrics = metrics if metrics is not None else PrefillMetrics()
        # Seconds of KV transfer per prompt token sent (moving average; 0: none yet): the
        # router's cost model prices a remote prefill with it.
        self.transfer_s_per_token = 0.0
        self.metrics.watch(worker_id, lambda: engine.last_stats,
                           lambda: dict(self.queued_by_class),
                           lambda: self.gate.queued_tokens, lambda: self.gate.active)

    def load(self, stats: EngineStats | None = None) -> WorkerLoad:
        """The record published on every heartbeat and served by Stats (the engine's numbers
        included: `stats`, else its last snapshot)."""
        return dataclasses.replace(
            WorkerLoad.from_dict(engine_load(self.engine.last_stats if stats is None else stats)),
            queued=self.gate.num_waiting, running=self.gate.active,
            queued_tokens=self.gate.queued_tokens,
            kv_transfer_s_per_token=self.transfer_s_per_token)

    def _free(self, request_id: str) -> None:
        """Free a prefill's blocks without waiting for it. The engine thread frees them
        between its steps, maybe behind another prompt's step of hundreds of ms; the
        prefill's reply (the router holds the stream's last token for it, for its timings)
        and the next prompt's slot need not wait that long: the engine runs commands in the
        order they come, so the next prompt's allocation comes after the free."""
        try:
            fut = self.engine.release_soon(request_id)
        except EngineClosedError:
            return  # stopping: the engine's blocks go with it
        self._freeing.add(fut)
        fut.add_done_callback(self._freed)

    def _freed(self, fut: asyncio.Future[None]) -> None:
        self._freeing.discard(fut)
        if not fut.cancelled() and (exc := fut.exception()) is not None:
            log.warning("prefill_release_failed", error=repr(exc))

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no prefill (queued, computing or transferring) is left and their blocks
        are free, or the timeout."""
        deadline = time.monotonic() + timeout_s
        while self.inflight or self._freeing:
            if time.monotonic() > deadline:
                log.warning("drain_timeout", inflight=self.inflight)
                return False
            await asyncio.sleep(0.05)
        return True

    async def prefill(self, req: GenerateRequest, dest: KVDestination | None
                      ) -> PrefillReport:
        if not self.accepting:
            self.metrics.requests.labels("rejected").inc()
            raise CapacityError(f"prefill worker {self.worker_id} is shutting down",
                                code=ErrorCode.WORKER_DRAINING)
        if self.inflight >= self.max_requests:  # the router prefills locally instead
            self.metrics.requests.labels("rejected").inc()
            raise CapacityError(f"prefill worker {self.worker_id} holds {self.inflight} "
                                "requests, its limit", code=ErrorCode.WORKER_FULL)
        arrived = time.monotonic()
        n = len(req.token_ids)
        lc = req.latency_class.value
        self.inflight += 1
        self.gate.queued_tokens += n
        self.queued_by_class[lc] += 1
        queued = True
        outcome = "cancelled"
        try:
            async with self.gate.slot(req.latency_class.priority):
                self.gate.queued_tokens -= n
                self.queued_by_class[lc] -= 1
                queued = False
                started = time.monotonic()
                self.metrics.queue_wait.labels(lc).observe(started - arrived)
                parts = None if dest is None else PartSender(
                    self.sender, self.engine.kv_pool, dest, timeout_s=self.transfer_timeout_s,
                    skip=dest.num_cached_tokens // self.engine.layout.block_size)
                try:
                    result = await self.engine.prefill(
                        req, parts.progress if parts is not None and self.overlap else None)
                except BaseException:
                    if parts is not None:
                        await parts.abort()  # before the engine reuses the blocks
                    raise
                computed = time.monotonic()
                self.metrics.compute.observe(computed - started)
                self.metrics.computed_tokens.inc(n - result.first.num_cached_tokens)
                try:
                    sent = 0
                    first = result.first
                    assert first.token_id is not None
                    if dest is not None:
                        assert parts is not None
                        sent = await self._transfer(result, dest, parts)
                    # The transfer stage ends here. With parts, it is what the transfer
                    # added after the compute.
                    transferred = time.monotonic()
                finally:
                    if parts is not None:
                        await parts.abort()  # a no-op once finished
                    self._free(req.request_id)
            outcome = "ok"
        except Exception:
            outcome = "failed"
            raise
        finally:
            self.inflight -= 1
            if queued:
                self.gate.queued_tokens -= n
                self.queued_by_class[lc] -= 1
            self.metrics.requests.labels(outcome).inc()
            if outcome != "ok":
                log.info("prefill_finished", outcome=outcome, prompt_tokens=n,
                         latency_class=lc)
        if sent:
            layout = self.engine.layout
            tokens = sent / (layout.block_nbytes / layout.block_size)
            rate = (transferred - computed) / tokens
            old = self.transfer_s_per_token
            self.transfer_s_per_token = rate if old == 0.0 else old + 0.2 * (rate - old)
        out = PrefillReport(
            worker_id=self.worker_id, queued_ms=(started - arrived) * 1000,
            compute_ms=(computed - started) * 1000,
            transfer_ms=(transferred - computed) * 1000, bytes_transferred=sent,
            num_computed_tokens=n - first.num_cached_tokens)
        log.info("prefill_finished", outcome=outcome, prompt_tokens=n, latency_class=lc,
                 computed_tokens=out.num_computed_tokens, queued_ms=round(out.queued_ms, 1),
                 compute_ms=round(out.compute_ms, 1), transfer_ms=round(out.transfer_ms, 1),
                 kv_bytes=sent)
        return out

    async def _transfer(self, result: PrefillResult, dest: KVDestination,
                        parts: PartSender) -> int:
        """Send the prompt's KV (what the parts did not) with the first token; bytes sent."""
        src_blocks = result.block_ids
        if len(dest.block_ids) != len(src_blocks):
            raise InvalidRequestError(
                f"destination has {len(dest.block_ids)} blocks, the prompt needs "
                f"{len(src_blocks)}", param="destination")
        first = result.first
        assert first.token_id is not None
        notice = FirstToken(first.token_id, first.logprob).to_notice()  # its one channel
        started = time.monotonic()
        try:
            nbytes = await parts.finish(src_blocks, result.num_preemptions, notice)
        except KVTransferError as exc:
            self.metrics.transfer_failures.labels(exc.code).inc()
            raise
        except asyncio.CancelledError:
            self.metrics.transfer_failures.labels("cancelled").inc()
            raise
        self.metrics.transfer.observe(time.monotonic() - started)
        self.metrics.transfer_bytes.inc(nbytes)
        return nbytes
