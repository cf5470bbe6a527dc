"""An emulated engine for the router load harness (bench.router_harness): the engine's real
`Scheduler` and `BlockManager`, priced by a measured step-cost profile instead of running a
model, behind the same asyncio surface as `pdserve.engine.async_engine.AsyncEngine` that the
real `decode_svc.worker.DecodeWorker` and `KVEventPublisher` use.

What is real: continuous batching, chunked prefill, latency-class priority, preemption, the
prefix cache (block hashes chained exactly as the engine chains them, with the model id as
the hash extra), its evictions and therefore its KV events (`take_kv_events` /
`kv_snapshot`, the publisher's source), the stats a worker publishes on its heartbeat, and the
request validation a worker does before a request reaches the engine.
What is emulated: the model. A step computes nothing; it lasts what the profile
(`bench.engine_profile`, the fit in docs/bench/cluster_sim/engine_profile.json, priced by
`bench.sim.workers.StepCost`) says the real engine's step with the same sequences and tokens
took on this machine, times `time_scale`. Sampled tokens are deterministic
(`emulated_token`), so a client can check every token it gets; EOS never ends a request.

Commands (add, abort) that arrive during a step are carried out when it ends, as the real
engine thread runs them between steps. Everything runs on the caller's event loop: many
engines share one process (bench.emulated_workers).

`oracle`: an optional `CacheOracle` that sees every cache change the moment it happens, so a
harness can ask which worker holds the longest prefix of a prompt right now.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from bench.sim.workers import StepCost
from pdserve.engine.block_manager import BlockHash, BlockManager, block_hashes
from pdserve.engine.config import EngineConfig
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import SeqMode, SeqStatus, Sequence
from pdserve.engine.stats import QUEUE_TIME_BUCKETS, DurationHistogram, EngineStats
from pdserve.engine.step_rates import StepRates
from pdserve.errors import (
    CapacityError,
    ErrorCode,
    InvalidRequestError,
    PdserveError,
    PromptTooLongError,
)
from pdserve.kv_events import KVOp
from pdserve.kv_layout import KVLayout
from pdserve.types import FinishReason, GenerateRequest, TokenEvent, TokenLogprob

VOCAB = 49152  # SmolLM2's vocabulary: the router's tokenizer and validation use that model


def emulated_token(prompt_len: int, last_prompt_token: int, i: int) -> int:
    """The `i`-th output token (0-based) of a request: a function of its prompt only."""
    return (last_prompt_token * 7919 + prompt_len * 31 + i * 104729 + 17) % VOCAB


class CacheOracle:
    """Which worker holds which block, updated synchronously with every engine's block
    manager (not through Redis or the router's index): the oracle of the hit-rate figure."""

    def __init__(self) -> None:
        self.holders: dict[BlockHash, set[str]] = {}

    def apply(self, worker_id: str, ops: list[tuple[KVOp, BlockHash]]) -> None:
        holders = self.holders
        for op, h in ops:
            if op is KVOp.STORED:
                s = holders.get(h)
                if s is None:
                    holders[h] = {worker_id}
                else:
                    s.add(worker_id)
            else:
                s = holders.get(h)
                if s is not None:
                    s.discard(worker_id)
                    if not s:
                        del holders[h]

    def drop(self, worker_id: str, hashes: list[BlockHash]) -> None:
        self.apply(worker_id, [(KVOp.REMOVED, h) for h in hashes])

    def best_blocks(self, hashes: list[BlockHash]) -> int:
        """Leading blocks of a prompt (its chained hashes) held by the best worker."""
        if not hashes:
            return 0
        cand = self.holders.get(hashes[0])
        if not cand:
            return 0
        depth = 1
        for h in hashes[1:]:
            s = self.holders.get(h)
            if not s:
                break
            cand = cand & s
            if not cand:
                break
            depth += 1
        return depth


class EmulatedEngine:
    """`AsyncEngine`'s surface over a real scheduler and block manager, stepped on the event
    loop by the profile's clock. Use `async with` or start/close."""

    def __init__(self, *, worker_id: str, model_id: str, num_blocks: int, block_size: int = 16,
                 max_model_len: int = 8192, cost: StepCost | None = None,
                 time_scale: float = 1.0, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_prefill_chunk: int = 512,
                 oracle: CacheOracle | None = None,
                 on_event: Callable[[TokenEvent], None] | None = None):
        self.worker_id = worker_id
        self.config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks,
                                   max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_prefill_chunk=max_prefill_chunk,
                                   max_model_len=max_model_len)
        # The KV geometry only names the model and the pool's size: nothing is transferred.
        self._layout = KVLayout(num_blocks, 1, block_size, 1, 1, "float32", model_id)
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(num_blocks, block_size, hash_extra=model_id.encode(),
                                          record_events=True)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.cost = cost or StepCost.load()
        self.time_scale = time_scale
        self.oracle = oracle
        self.on_event = on_event
        self.rates = StepRates()
        self.queue_time = DurationHistogram(QUEUE_TIME_BUCKETS)
        self.num_steps = 0
        self.num_preemptions = 0
        self.step_seconds = 0.0  # emulated compute, summed
        self._seqs: dict[str, Sequence] = {}
        self._streams: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._events: list[tuple[KVOp, BlockHash]] = []  # for the KV event publisher
        self._overflowed = False
        self._deferred: list[Callable[[], None]] = []
        self._busy = False  # a step is being "computed"
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stats = self._make_stats()
        self.step_listeners: list[Callable[[EngineStats], None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"emulated-engine-{self.worker_id}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for rid in list(self._seqs):
            ev = self._abort_now(rid)
            q = self._streams.pop(rid, None)
            if ev is not None and q is not None:
                q.put_nowait(ev)

    async def __aenter__(self) -> EmulatedEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ read-only views

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def kv_pool(self) -> Any:
        raise PdserveError("an emulated engine has no KV pool (no remote prefill)")

    @property
    def last_stats(self) -> EngineStats:
        return self._stats

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def _make_stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(
            running=len(s.running), waiting=s.num_waiting, awaiting_kv=len(s.awaiting_kv),
            held=len(s.held), free_blocks=bm.num_free_blocks, total_blocks=bm.num_blocks,
            prefix_cache_hit_rate=bm.prefix_hit_rate, steps=self.num_steps,
            preemptions=self.num_preemptions, prefix_cache_queries=bm.prefix_query_tokens,
            prefix_cache_hits=bm.prefix_hit_tokens,
            prefill_tokens_per_s=self.rates.prefill_tokens_per_s,
            decode_step_s=self.rates.decode_step_s,
            waiting_prompt_tokens=s.waiting_prompt_tokens,
            queue_time=self.queue_time.snapshot())

    # ------------------------------------------------------------------ cache upkeep

    def _drain_cache_events(self) -> None:
        """Move the block manager's changes to the publisher's list and the oracle."""
        bm = self.block_manager
        if bm.events_overflowed:
            self._overflowed = True
        ops = bm.drain_events()
        if not ops:
            return
        if self.oracle is not None:
            self.oracle.apply(self.worker_id, ops)
        if not self._overflowed:
            self._events.extend(ops)

    def warm(self, token_ids: list[int] | Any, request_id: str) -> int:
        """Leave `token_ids`' full blocks in the prefix cache, as a finished request does
        (allocated, computed, freed). Returns the blocks it added; 0 when the pool is full."""
        bm = self.block_manager
        n = len(token_ids)
        alloc = bm.allocate_prompt(request_id, token_ids, n, max_cached=n - 1)
        if alloc is None:
            return 0
        table, cached = alloc
        bm.register_full_blocks(request_id, token_ids, n, table)
        bm.free(request_id, table)
        self._drain_cache_events()
        self._stats = self._make_stats()
        return n // bm.block_size - cached // bm.block_size

    # ------------------------------------------------------------------ the step loop

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if not self.scheduler.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            out = self.scheduler.schedule()
            self.num_preemptions += len(out.preempted)
            events: list[TokenEvent] = []
            for seq in out.preempted:
                if self.block_manager.blocks_needed(seq.num_tokens + 1) > \
                        self.block_manager.num_blocks:
                    events.append(self._finish(seq, FinishReason.LENGTH))
            if not out.scheduled:
                self._deliver(events)
                # Nothing fits right now (every block held): wait for a command to change it.
                self._wake.clear()
                await self._wake.wait()
                continue
            now = time.monotonic()
            for s in out.scheduled:
                if not s.seq.first_scheduled:
                    s.seq.first_scheduled = now
                    self.queue_time.observe(now - s.seq.arrival)
            seconds = self.time_scale * self.cost.step_s(
                [(s.start, s.num_new_tokens) for s in out.scheduled])
            self._busy = True
            try:
                await asyncio.sleep(seconds)
            finally:
                self._busy = False
            self.step_seconds += seconds
            self.scheduler.postprocess(out)
            self.num_steps += 1
            for s in out.scheduled:
                if s.samples and s.seq.status is SeqStatus.RUNNING:
                    seq = s.seq
                    tok = emulated_token(seq.num_prompt_tokens, seq.prompt_token_ids[-1],
                                         seq.num_output_tokens)
                    events.append(self._process_token(seq, tok))
            prefill_tokens = sum(s.num_new_tokens for s in out.scheduled
                                 if s.start < s.seq.num_prompt_tokens)
            self.rates.observe(seconds, prefill_tokens)
            self._deliver(events)
            self._run_deferred()

    def _deliver(self, events: list[TokenEvent]) -> None:
        self._drain_cache_events()
        self._stats = stats = self._make_stats()
        for ev in events:
            q = self._streams.get(ev.request_id)
            if q is not None:
                q.put_nowait(ev)
            if self.on_event is not None:
                self.on_event(ev)
        for listener in self.step_listeners:
            listener(stats)

    def _run_deferred(self) -> None:
        cmds, self._deferred = self._deferred, []
        for cmd in cmds:
            cmd()

    async def _command(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` now, or at the end of the step being computed (as the engine thread
        runs commands between steps)."""
        if not self._busy:
            result = fn()
            self._after_command()
            return result
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the caller
                if not fut.done():
                    fut.set_exception(exc)
            else:
                if not fut.done():
                    fut.set_result(result)
            self._after_command()

        self._deferred.append(run)
        return await fut

    def _after_command(self) -> None:
        self._drain_cache_events()
        self._stats = self._make_stats()
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------ requests

    def _validate(self, req: GenerateRequest) -> None:
        if req.request_id in self._seqs:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}",
                                      param="request_id")
        n = len(req.token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {n} tokens; context is {self.max_model_len}",
                                     param="prompt")
        for t in req.token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < VOCAB:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary",
                                          param="prompt")
        if self.block_manager.blocks_needed(n + 1) > self.block_manager.num_blocks:
            raise PromptTooLongError(f"prompt has {n} tokens, more than this worker's KV "
                                     f"cache can ever hold", param="prompt")

    def _add(self, req: GenerateRequest) -> None:
        self._validate(req)
        seq = Sequence(req.request_id, list(req.prompt_token_ids), req.sampling,
                       latency_class=req.latency_class, mode=SeqMode.GENERATE)
        for tok in req.resume_output_ids:
            seq.append_token(tok)
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def _process_token(self, seq: Sequence, tok: int) -> TokenEvent:
        seq.append_token(tok)
        if (seq.num_output_tokens >= seq.sampling.max_tokens
                or seq.num_tokens >= self.max_model_len):
            return self._finish(seq, FinishReason.LENGTH, token=tok)
        return self._event(seq, tok)

    def _finish(self, seq: Sequence, reason: FinishReason, *, token: int | None = None,
                error: str | None = None) -> TokenEvent:
        self.scheduler.finish(seq, reason)
        self._seqs.pop(seq.request_id, None)
        return self._event(seq, token, reason, error)

    @staticmethod
    def _event(seq: Sequence, token: int | None, reason: FinishReason | None = None,
               error: str | None = None) -> TokenEvent:
        return TokenEvent(
            request_id=seq.request_id, token_id=token, text="", logprob=None,
            finish_reason=reason, error=error, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, num_output_tokens=seq.num_output_tokens)

    def _abort_now(self, request_id: str) -> TokenEvent | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, FinishReason.ABORT)

    def _open_stream(self, request_id: str) -> asyncio.Queue[TokenEvent]:
        if request_id in self._streams:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", param="request_id")
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def _abort_soon(self, request_id: str) -> None:
        def abort() -> None:
            self._abort_now(request_id)
        if self._busy:
            self._deferred.append(lambda: (abort(), self._after_command()))
        else:
            abort()
            self._after_command()

    # ------------------------------------------------------------------ public API

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Prefill and decode; yields events until one with a finish_reason. Closing the
        iterator aborts the request and frees its blocks."""
        q = self._open_stream(req.request_id)
        try:
            await self._command(lambda: self._add(req))
        except BaseException:
            self._streams.pop(req.request_id, None)
            self._abort_soon(req.request_id)
            raise
        finished = False
        try:
            while True:
                ev = await q.get()
                finished = ev.finished
                yield ev
                if finished:
                    return
        finally:
            if self._streams.get(req.request_id) is q:
                del self._streams[req.request_id]
                if not finished:
                    self._abort_soon(req.request_id)

    async def allocate_remote(self, req: GenerateRequest) -> Any:
        raise CapacityError("an emulated engine takes no remote prefill",
                            code=ErrorCode.KV_PENDING_LIMIT)

    async def admit_remote(self, request_id: str, first_token: int,
                           logprob: TokenLogprob | None = None) -> AsyncIterator[TokenEvent]:
        raise PdserveError(f"request {request_id!r} was not allocated here")
        yield  # pragma: no cover - an async generator

    async def prefill(self, req: GenerateRequest) -> Any:
        raise PdserveError("an emulated engine serves decode workers only")

    async def release(self, request_id: str) -> None:
        return None

    async def abort(self, request_id: str) -> None:
        ev = await asyncio.shield(self._command(lambda: self._abort_now(request_id)))
        q = self._streams.pop(request_id, None)
        if ev is not None and q is not None:
            q.put_nowait(ev)

    async def num_cached_tokens(self, token_ids: list[int] | tuple[int, ...]) -> int:
        return self.block_manager.num_cached_tokens(token_ids)

    def cached_tokens_now(self, hashes: list[BlockHash]) -> int:
        """Leading tokens of a prompt (its chained hashes, `prompt_hashes`) in this cache
        right now, block aligned (the block manager's own lookup, given the hashes)."""
        bm = self.block_manager
        n = len(hashes) * bm.block_size
        return bm.num_cached_tokens([0] * n, list(hashes))

    def prompt_hashes(self, token_ids: Any) -> list[BlockHash]:
        return block_hashes(token_ids, self.block_manager.block_size,
                            self.block_manager.hash_extra)

    @property
    def kv_event_count(self) -> int:
        return self.block_manager.event_count

    async def take_kv_events(self) -> list[tuple[KVOp, bytes]] | None:
        self._drain_cache_events()
        if self._overflowed:
            return None
        events, self._events = self._events, []
        return events

    async def kv_snapshot(self) -> list[bytes]:
        self._drain_cache_events()
        self._events = []
        self._overflowed = False
        self.block_manager.take_snapshot()
        return self.block_manager.cached_hashes()

    async def stats(self) -> EngineStats:
        return self._stats

    async def call(self, fn: Callable[[], Any]) -> Any:
        return await self._command(fn)
