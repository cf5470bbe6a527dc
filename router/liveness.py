"""Is a worker still there? Probes, lost workers, and streams that end when theirs is lost.

A worker that leaves the directory is probed once: one that answers is draining (its streams
may finish within the drain grace); one that does not is declared *lost* and every stream on
it moves at once instead of waiting for a token or prefill deadline. A stream that gets
nothing for `stall_probe_s` has its worker probed too, so a worker that keeps its lease but
stopped answering (gRPC path cut, process wedged) is found long before a token deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import Counter

from pdserve.control.directory import WorkerDirectory
from pdserve.control.workers import WorkerInfo
from pdserve.types import TokenEvent
from router.clients import WorkerChannels

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class LivenessConfig:
    # A worker whose lease lapsed is probed once with this deadline: no answer means it is
    # dead or hung, and its requests move (a draining worker answers and keeps its streams).
    lost_probe_timeout_s: float = 2.0
    # A stream that gets nothing for this long has its worker probed (see above): a worker
    # that keeps its lease but does not answer is treated as lost too.
    stall_probe_s: float = 5.0
    stall_probe_failures: int = 3  # probes in a row a registered worker must miss
    drain_grace_s: float = 300.0  # streams on a worker that left may finish within this


class Liveness:
    """Lost workers, as futures that resolve when a worker is declared lost."""

    def __init__(self, config: LivenessConfig, directory: WorkerDirectory,
                 channels: WorkerChannels, workers_lost: Counter,
                 spawn: Callable[[Coroutine[Any, Any, None]], None]):
        self.config = config
        self._directory = directory
        self._channels = channels
        self._workers_lost = workers_lost
        self._spawn = spawn
        # worker id -> resolved when that worker is declared lost (see check_left)
        self._lost: dict[str, asyncio.Future[None]] = {}
        self._probing: set[str] = set()  # worker ids with a stall probe in flight
        self.generation = 0  # moves whenever a worker is declared lost or taken back
        # Called with each worker as it is declared lost (the compiled data plane ends its
        # session to it: router.dataplane).
        self.on_lost: list[Callable[[WorkerInfo], None]] = []

    def joined(self, worker_id: str) -> None:
        """A worker (re)joined the directory: a lost one is usable again (e.g. SIGCONT)."""
        lost = self._lost.get(worker_id)
        if lost is not None and lost.done():
            del self._lost[worker_id]
            self.generation += 1

    async def check_left(self, w: WorkerInfo) -> None:
        """A worker left the directory: deregistered to drain (it still answers, so its
        streams may finish within the drain grace), or its lease lapsed because it died, hung
        or was cut off (no answer to one probe): then its requests move now instead of
        waiting for a token or prefill deadline."""
        failure = await self.probe(w)
        if w.worker_id in self._directory.snapshot():
            # It joined again while the probe ran (a partition healed within the probe's
            # deadline): the probe's answer is about a link that is back. Declared lost now, it
            # would stay so while registered, and never be sent a request again.
            log.info("worker_back_during_probe", worker_id=w.worker_id, role=w.role,
                     probe=failure or "answered")
            return
        if failure is None:
            self._channels.drop(w.grpc_address, self.config.drain_grace_s)
        else:
            self.declare_lost(w, failure)
            self._channels.drop(w.grpc_address, grace_s=1.0)

    async def probe(self, w: WorkerInfo) -> str | None:
        """One health check within `lost_probe_timeout_s`: None if the worker answered, else
        why not. Answered by the worker's event loop, so a long engine step is no failure."""
        client = (self._channels.decode(w) if w.role == "decode"
                  else self._channels.prefill(w))
        timeout_s = self.config.lost_probe_timeout_s
        if await client.alive(timeout_s=timeout_s):
            return None
        return f"no answer to a health check within {timeout_s:g}s"

    def declare_lost(self, w: WorkerInfo, why: str) -> None:
        lost = self.lost_future(w.worker_id)
        if not lost.done():
            log.warning("worker_lost", worker_id=w.worker_id, role=w.role, probe=why)
            self._workers_lost.labels(w.role).inc()
            lost.set_result(None)
            self.generation += 1
            for hook in self.on_lost:
                hook(w)

    def stalled(self, w: WorkerInfo) -> None:
        """A stream on `w` got nothing for `stall_probe_s`: probe the worker (one prober per
        worker). A worker that holds its lease but misses `stall_probe_failures` probes in a
        row (its gRPC path cut, its process wedged) is declared lost, so its silent streams
        migrate long before the token deadline; while it stays registered it is probed again
        and taken back once it answers."""
        if w.worker_id in self._probing:
            return
        self._probing.add(w.worker_id)
        cfg = self.config

        async def probe() -> None:
            failures = 0
            try:
                while w.worker_id in self._directory.snapshot():
                    failure = await self.probe(w)
                    if failure is None:
                        if self.is_lost(w.worker_id):
                            log.info("worker_recovered", worker_id=w.worker_id, role=w.role)
                            del self._lost[w.worker_id]  # answers again: may take requests
                            self.generation += 1
                        return
                    failures += 1
                    if failures >= cfg.stall_probe_failures:
                        self.declare_lost(w, failure)
                    await asyncio.sleep(1.0 if failures < cfg.stall_probe_failures
                                        else cfg.stall_probe_s)
            finally:
                self._probing.discard(w.worker_id)
        self._spawn(probe())

    def is_lost(self, worker_id: str) -> bool:
        lost = self._lost.get(worker_id)
        return lost is not None and lost.done()

    def lost_future(self, worker_id: str) -> asyncio.Future[None]:
        fut = self._lost.get(worker_id)
        if fut is None:
            fut = self._lost[worker_id] = asyncio.get_running_loop().create_future()
        return fut

    def watch(self, w: WorkerInfo, events: AsyncIterator[TokenEvent],
              error: Callable[[], BaseException]) -> AsyncGenerator[TokenEvent, None]:
        """`events` of a stream on `w`, ended with `error()` once `w` is lost and the stream
        silent; a silent stream has `w` probed (`stalled`)."""
        return until_lost(self.lost_future(w.worker_id), events, error,
                          stall_s=self.config.stall_probe_s, on_stall=lambda: self.stalled(w))


async def until_lost(lost: asyncio.Future[None], events: AsyncIterator[TokenEvent],
                     error: Callable[[], BaseException], *, stall_s: float,
                     on_stall: Callable[[], None] | None = None,
                     ) -> AsyncGenerator[TokenEvent, None]:
    """`events`, until the worker is lost *and* its stream silent: once `lost` resolves, a
    read that has waited `stall_s` since the last event is cancelled (the stream closes) and
    `error()` is raised; a stream still delivering goes on (a live worker whose lease lapsed
    because it was starved of CPU). `on_stall()` is called each time a read waits `stall_s`.

    The events are read in the consumer's own task: one timer per stream, re-armed only when
    it fires (at most once per `stall_s`), and one callback on `lost` watch the silence, and
    cancel the read when it must end. Nothing is created per event (a task and a wait per
    token cost the router more than the token's own relay)."""
    loop = asyncio.get_running_loop()
    task: asyncio.Task[Any] | None = None  # the one reading now (the consumer's)
    last = time.monotonic()
    reading = cut = False
    timer: asyncio.TimerHandle | None = None

    def cut_read() -> None:
        nonlocal cut
        if reading and not cut and task is not None:
            cut = True
            task.cancel()

    def tick() -> None:
        nonlocal timer
        silent = time.monotonic() - last
        if reading and silent >= stall_s:
            if lost.done():
                cut_read()
                return
            if on_stall is not None:
                on_stall()
            silent = 0.0
        # next when the silence would reach stall_s (a held stream: stall_s from now)
        timer = loop.call_later(stall_s - silent if reading else stall_s, tick)

    def on_lost(_: asyncio.Future[None]) -> None:
        if time.monotonic() - last >= stall_s:
            cut_read()  # else the timer cuts it when the silence reaches stall_s

    timer = loop.call_later(stall_s, tick)
    lost.add_done_callback(on_lost)
    try:
        while True:
            if lost.done() and time.monotonic() - last >= stall_s:
                raise error()  # lost, and silent since before this read
            task = asyncio.current_task()  # whichever task iterates this one now
            reading = True
            try:
                ev = await anext(events)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if cut and task is not None and task.uncancel() == 0:
                    raise error() from None
                raise
            finally:
                reading = False
            last = time.monotonic()
            yield ev
    finally:
        if timer is not None:
            timer.cancel()
        lost.remove_done_callback(on_lost)
        # `tick` names itself (it re-arms its timer): a cycle through its closure that would
        # keep the reading task, its context and everything they hold for the cyclic GC to
        # find, whose collections pause every request on the loop. Broken here instead.
        tick = timer = task = None  # type: ignore[assignment]
        await events.aclose()  # type: ignore[attr-defined]
