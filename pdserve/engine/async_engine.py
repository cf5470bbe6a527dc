"""asyncio front of the engine. The engine runs on its own thread; the event loop never
computes.

Every call into the LLMEngine is a command executed on the engine thread between steps, so
the engine stays single-threaded. Token events are handed back to the loop once per step.

This class is the engine's boundary: services (decode_svc, prefill_svc, gateway) use only its
public properties and coroutines, never the LLMEngine behind it. The properties are safe to
read from any thread: they are immutable (`layout`, `max_model_len`, `kv_pool`'s identity) or
a snapshot replaced atomically by the engine thread (`last_stats`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from pdserve.aio import AsyncResource
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RemoteAllocation
from pdserve.engine.stats import EngineStats
from pdserve.errors import EngineClosedError, InvalidRequestError, PdserveError
from pdserve.kv_events import KVOp
from pdserve.kv_layout import KVLayout
from pdserve.types import GenerateRequest, TokenEvent, TokenLogprob

log = structlog.get_logger(__name__)
T = TypeVar("T")


async def load_engine(model_dir: Path, config: EngineConfig) -> LLMEngine:
    """`LLMEngine.from_dir` off the event loop, on a thread of its own that ends with it.

    Not `asyncio.to_thread`: loading runs torch ops, and a thread that ran one keeps an
    OpenMP thread pool for as long as it lives (the default executor's threads live as long
    as the process). With a second pool alive, libgomp sees more threads than CPUs and
    stops spinning between parallel regions: every GEMM of the engine thread then pays a
    sleep and a wake-up, and a decode step took 13 % longer (33.8 vs 29.9 ms, SmolLM2-135M
    fp32, 2 cores; a batch-16 GEMM 327 vs 248 us). So in a worker only the engine thread
    ever keeps a pool."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[LLMEngine] = loop.create_future()

    def settle(result: LLMEngine | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def load() -> None:
        try:
            engine = LLMEngine.from_dir(model_dir, config)
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, engine, None)

    threading.Thread(target=load, name="pdserve-load", daemon=True).start()
    return await done


@dataclass(frozen=True)
class PrefillResult:
    """A finished prefill-only request: first token plus the blocks holding its KV.

    The blocks stay reserved until `AsyncEngine.release(request_id)`.
    """

    first: TokenEvent
    block_ids: tuple[int, ...]
    # Times the engine preempted it (its blocks were freed and the prompt recomputed): what a
    # `progress` callback was shown before the last preemption is not its KV.
    num_preemptions: int = 0


PrefillProgress = Callable[[int, tuple[int, ...]], None]
"""Called on the event loop after each step that computed a chunk of a prefill-only prompt
(not the last one): (preemptions so far, the blocks whose KV is now final, in prompt
order). The blocks stay valid while the request runs and no preemption follows."""


class AsyncEngine(AsyncResource):
    """Owns an LLMEngine and the thread that drives it. Use `async with` or start/close."""

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._commands = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._progress: dict[str, PrefillProgress] = {}  # set on the loop, read by the thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Written by the engine thread only (and here, before it starts); readers on other
        # threads see either the old or the new snapshot, both consistent.
        self._stats: EngineStats = engine.stats()
        self.step_listeners: list[Callable[[EngineStats], None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Abort whatever is still running and stop the engine thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._engine.close()


    # ------------------------------------------------------------------ read-only views

    @property
    def running(self) -> bool:
        """True between `start()` and `close()` while the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def layout(self) -> KVLayout:
        """Geometry and identity of this engine's KV pool (immutable)."""
        return self._engine.layout

    @property
    def kv_pool(self) -> torch.Tensor:
        """The KV pool tensor laid out as `layout`, for KV transfer to read or write blocks.

        The tensor object never changes; its contents belong to whoever holds the blocks (a
        prefill result until `release`, a remote allocation until `admit_remote` or `abort`).
        """
        return self._engine.kv_pool

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output tokens) this engine accepts."""
        return self._engine.max_model_len

    @property
    def last_stats(self) -> EngineStats:
        """The engine's latest stats snapshot: refreshed after every step and after every
        batch of commands (an abort or release between steps) *before* their results are
        handed back, so a caller that awaited an abort already sees its blocks free."""
        return self._stats

    @property
    def num_streams(self) -> int:
        """Requests whose token stream is open here (a consumer may still read it)."""
        return len(self._streams)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        eng = self._engine
        while True:
            self._drain_commands()
            if self._stopping:
                events = [e for rid in list(self._streams) if (e := eng.abort(rid))]
                self._deliver(events)
                self._drain_commands()
                return
            if not eng.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                events = eng.step()
            except Exception as exc:  # a step failing must not hang every stream
                log.exception("engine step failed")
                events = eng.fail_all(f"engine step failed: {exc}")
            self._report_progress()
            self._deliver(events)

    def _drain_commands(self) -> None:
        done: list[tuple[concurrent.futures.Future[Any], Any, BaseException | None]] = []
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                done.append((fut, fn(), None))
            except BaseException as exc:
                done.append((fut, None, exc))
        if not done:
            return
        # Aborts and releases change the numbers between steps too; refresh before any caller
        # resumes, so what it reads next already shows its command's effect.
        self._stats = self._engine.stats()
        for fut, result, error in done:
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

    def _report_progress(self) -> None:
        """Engine thread: each watched prefill's progress, queued on the loop ahead of the
        step's events."""
        if not self._progress or self._loop is None:
            return
        for request_id, callback in list(self._progress.items()):
            progress = self._engine.prefill_progress(request_id)
            if progress is not None:
                with _loop_closed_ok():
                    self._loop.call_soon_threadsafe(callback, *progress)

    def _deliver(self, events: list[TokenEvent]) -> None:
        stats = self._engine.stats()
        self._stats = stats
        if self._loop is not None and not self._loop.is_closed():
            with _loop_closed_ok():
                self._loop.call_soon_threadsafe(self._dispatch, events, stats)

    def _dispatch(self, events: list[TokenEvent], stats: EngineStats) -> None:
        for ev in events:
            q = self._streams.get(ev.request_id)
            if q is not None:
                q.put_nowait(ev)
        for listener in self.step_listeners:
            listener(stats)

    # ------------------------------------------------------------------ commands

    def _submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        if self._thread is None or self._stopping:
            raise EngineClosedError("engine is not running")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self._submit(fn))

    def _abort_soon(self, request_id: str) -> None:
        if self._thread is not None and not self._stopping:
            self._submit(lambda: self._engine.abort(request_id))

    def _open_stream(self, request_id: str) -> asyncio.Queue[TokenEvent]:
        # Checked here, before touching state: a refused duplicate must not disturb the live
        # request that owns the id (its queue, or its blocks via the abort on failure).
        if request_id in self._streams:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", param="request_id")
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def _undo_open(self, request_id: str, exc: BaseException) -> None:
        """The command that adds ``request_id`` failed or was cancelled."""
        self._streams.pop(request_id, None)
        if not isinstance(exc, PdserveError):  # cancelled: the command may still have run
            self._abort_soon(request_id)

    async def _stream(self, request_id: str, q: asyncio.Queue[TokenEvent]) -> AsyncIterator[
            TokenEvent]:
        finished = False
        try:
            while True:
                ev = await q.get()
                finished = ev.finished
                yield ev
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is q:  # the id may already serve a new request
                del self._streams[request_id]
                if not finished:  # consumer went away (cancelled, closed, disconnected)
                    self._abort_soon(request_id)

    # ------------------------------------------------------------------ public API

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Prefill locally and decode; yields events until one with a finish_reason.

        Closing or cancelling the iterator aborts the request and frees its blocks.
        """
        q = self._open_stream(req.request_id)
        try:
            await self.call(lambda: self._engine.add_request(req))
        except BaseException as exc:
            self._undo_open(req.request_id, exc)
            raise
        async for ev in self._stream(req.request_id, q):
            yield ev

    async def prefill(self, req: GenerateRequest, progress: PrefillProgress | None = None
                      ) -> PrefillResult:
        """Compute ``req``'s prompt KV and first token; the blocks stay held until release.
        `progress` is told of each chunk but the last as it is computed (PrefillProgress)."""
        rid = req.request_id
        q = self._open_stream(rid)
        if progress is not None:
            self._progress[rid] = progress
        try:
            try:
                await self.call(lambda: self._engine.add_request(req, prefill_only=True))
            except BaseException as exc:
                self._undo_open(rid, exc)
                raise
            try:
                ev = await q.get()
            except BaseException:
                self._streams.pop(rid, None)
                self._abort_soon(rid)  # also releases held blocks
                raise
        finally:
            self._progress.pop(rid, None)
        self._streams.pop(rid, None)
        if ev.finish_reason is not None and ev.token_id is None:
            raise PdserveError(ev.error or f"prefill ended: {ev.finish_reason}")
        try:
            blocks, preemptions = await self.call(
                lambda: (self._engine.held_blocks(rid), self._engine.preemptions_of(rid)))
        except BaseException:
            self._abort_soon(rid)  # releases the held blocks
            raise
        return PrefillResult(ev, blocks, preemptions)

    async def release(self, request_id: str) -> None:
        """Free a prefill-only request's held blocks. It is carried out even if the caller is
        cancelled meanwhile (a cancelled call would otherwise be dropped before the engine
        thread ran it, and the blocks stay held for ever)."""
        await asyncio.shield(self.release_soon(request_id))

    def release_soon(self, request_id: str) -> asyncio.Future[None]:
        """`release`, queued on the engine thread now, ahead of every later command (it runs
        them in order), without waiting for the step it may queue behind."""
        return asyncio.wrap_future(self._submit(lambda: self._engine.release(request_id)))

    async def allocate_remote(self, req: GenerateRequest) -> RemoteAllocation:
        self._open_stream(req.request_id)
        try:
            return await self.call(lambda: self._engine.allocate_remote(req))
        except BaseException as exc:
            self._undo_open(req.request_id, exc)
            raise

    async def admit_remote(self, request_id: str, first_token: int,
                           logprob: TokenLogprob | None = None) -> AsyncIterator[TokenEvent]:
        """Start decoding an allocated request whose KV has been written; yields its events,
        beginning with the first token."""
        q = self._streams.get(request_id)
        if q is None:
            raise PdserveError(f"request {request_id!r} was not allocated here")

        loop = asyncio.get_running_loop()

        def admit() -> None:
            ev = self._engine.admit_remote(request_id, first_token, logprob)
            # Queued on the loop before any later step's events, so the first token leads.
            loop.call_soon_threadsafe(q.put_nowait, ev)

        try:
            await self.call(admit)
        except BaseException:
            self._streams.pop(request_id, None)
            self._abort_soon(request_id)
            raise
        async for ev in self._stream(request_id, q):
            yield ev

    async def abort(self, request_id: str) -> None:
        """End a request (any state) and free its blocks, then return. Carried out even if the
        caller is cancelled meanwhile (see `release`)."""
        ev = await asyncio.shield(self.call(lambda: self._engine.abort(request_id)))
        # A consumer still iterating holds its queue; the id itself is free for reuse now.
        q = self._streams.pop(request_id, None)
        if ev is not None and q is not None:
            q.put_nowait(ev)

    async def num_cached_tokens(self, token_ids: list[int] | tuple[int, ...]) -> int:
        return await self.call(lambda: self._engine.num_cached_tokens(token_ids))

    @property
    def kv_event_count(self) -> int:
        """Prefix-cache changes recorded so far (grows only once `take_kv_events` or
        `kv_snapshot` started the recording): poll it to know when to take events."""
        return self._engine.block_manager.event_count

    async def take_kv_events(self) -> list[tuple[KVOp, bytes]] | None:
        """Prefix-cache changes since the last call, in order (pdserve.kv_events); None when
        the engine's bounded queue overflowed and only `kv_snapshot` can resynchronise.
        The first call starts the recording."""
        def take() -> list[tuple[KVOp, bytes]] | None:
            bm = self._engine.block_manager
            bm.enable_events()
            if bm.events_overflowed:
                return None
            return list(bm.drain_events())
        return await self.call(take)

    async def kv_snapshot(self) -> list[bytes]:
        """Every block hash the prefix cache holds now; later `take_kv_events` calls return
        what changed after it (queued changes before it are dropped)."""
        def snap() -> list[bytes]:
            bm = self._engine.block_manager
            bm.enable_events()
            return list(bm.take_snapshot())
        return await self.call(snap)

    async def stats(self) -> EngineStats:
        return await self.call(self._engine.stats)


@contextlib.contextmanager
def _loop_closed_ok() -> Iterator[None]:
    """Around call_soon_threadsafe from the engine thread: the loop may close while we
    compute."""
    try:
        yield
    except RuntimeError:
        pass
