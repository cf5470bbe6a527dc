"""The prefill worker's domain logic, independent of gRPC."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import structlog

from engine.async_engine import AsyncEngine
from engine.types import CapacityError, GenerateRequest, TokenLogprob
from kvxfer.sender import KVSender

log = structlog.get_logger(__name__)


class PriorityGate:
    """At most ``limit`` holders at once; waiters are admitted by (priority, arrival), so an
    interactive request never queues behind batch ones."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._counter = itertools.count()
        self.queued_tokens = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        if self.active >= self.limit or self._waiters:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (priority, next(self._counter), fut)
            heapq.heappush(self._waiters, entry)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._release()  # we were granted the slot just as we were cancelled
                else:
                    self._waiters.remove(entry)
                    heapq.heapify(self._waiters)
                raise
        else:
            self.active += 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)  # the slot passes straight to the waiter
                return
        self.active -= 1


@dataclass(frozen=True)
class Destination:
    descriptor_id: str
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    transfer_id: str


@dataclass(frozen=True)
class PrefillOutcome:
    first_token: int
    logprob: TokenLogprob | None
    queued_ms: float
    compute_ms: float
    transfer_ms: float
    bytes_transferred: int
    num_computed_tokens: int


class PrefillWorker:
    def __init__(self, engine: AsyncEngine, sender: KVSender, *, worker_id: str,
                 max_inflight: int = 4, transfer_timeout_s: float = 30.0):
        self.engine = engine
        self.sender = sender
        self.worker_id = worker_id
        self.gate = PriorityGate(max_inflight)
        self.transfer_timeout_s = transfer_timeout_s
        self.accepting = True
        self.inflight = 0

    def load(self) -> dict[str, float]:
        s = self.engine.last_stats
        return {"queued": self.gate.num_waiting, "running": self.gate.active,
                "queued_tokens": self.gate.queued_tokens, "free_blocks": s.free_blocks,
                "total_blocks": s.total_blocks}

    async def prefill(self, req: GenerateRequest, dest: Destination | None) -> PrefillOutcome:
        if not self.accepting:
            raise CapacityError(f"prefill worker {self.worker_id} is shutting down",
                                code="worker_draining")
        arrived = time.monotonic()
        n = len(req.prompt_token_ids)
        self.inflight += 1
        self.gate.queued_tokens += n
        queued = True
        try:
            async with self.gate.slot(req.latency_class.priority):
                self.gate.queued_tokens -= n
                queued = False
                started = time.monotonic()
                result = await self.engine.prefill(req)
                computed = time.monotonic()
                try:
                    sent = 0
                    first = result.first
                    assert first.token_id is not None
                    if dest is not None:
                        sent = await self._transfer(result.block_ids, dest, first.token_id,
                                                    first.logprob)
                finally:
                    await self.engine.release(req.request_id)
                done = time.monotonic()
        finally:
            self.inflight -= 1
            if queued:
                self.gate.queued_tokens -= n
        return PrefillOutcome(
            first_token=first.token_id, logprob=first.logprob,
            queued_ms=(started - arrived) * 1000, compute_ms=(computed - started) * 1000,
            transfer_ms=(done - computed) * 1000, bytes_transferred=sent,
            num_computed_tokens=n - first.num_cached_tokens)

    async def _transfer(self, src_blocks: tuple[int, ...], dest: Destination, first_token: int,
                        logprob: TokenLogprob | None) -> int:
        if len(dest.block_ids) != len(src_blocks):
            from engine.types import InvalidRequestError

            raise InvalidRequestError(
                f"destination has {len(dest.block_ids)} blocks, the prompt needs "
                f"{len(src_blocks)}", param="destination")
        skip = dest.num_cached_tokens // self.engine.layout.block_size
        notice = {"first_token": first_token,
                  "logprob": None if logprob is None else logprob.logprob}
        res = await self.sender.send(dest.descriptor_id, self.engine.engine.kv_pool,
                                     src_blocks[skip:], dest.block_ids[skip:], dest.transfer_id,
                                     timeout_s=self.transfer_timeout_s, notice=notice)
        return res.nbytes
