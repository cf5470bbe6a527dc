"""The router's live view of workers, following leases as they come and go."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import structlog

from pdserve.aio import AsyncResource, stop_task
from pdserve.control.registry import WorkerRegistry
from pdserve.control.workers import Role, WorkerInfo
from pdserve.errors import ControlPlaneError

log = structlog.get_logger(__name__)

EventKind = Literal["added", "updated", "removed"]


@dataclass(frozen=True)
class WorkerEvent:
    """A change in the directory. `previous` is the record before an update or removal."""

    kind: EventKind
    worker: WorkerInfo
    previous: WorkerInfo | None = None

    @property
    def restarted(self) -> bool:
        """The worker id is now held by a new incarnation: its in-flight work is gone."""
        return self.previous is not None and self.previous.epoch != self.worker.epoch


class WorkerDirectory(AsyncResource):
    """Polls the registry every `poll_s`; a worker whose lease lapsed drops out on the next poll.

    `snapshot()` is always safe to read. If Redis is unreachable the last known view is kept
    (`last_refresh` stops advancing, `staleness_s()` grows) rather than routing to nobody --
    for at most `max_staleness_s`: past that the view is `expired` and `snapshot()` and `get()`
    answer as if no worker were registered, until a poll succeeds again (the view itself is
    kept, so no worker is reported removed and re-added because Redis was away). After an
    outage, workers missing from Redis are kept for `rejoin_grace_s` while they re-register.
    With `model_id`, workers serving another model are never listed (and said so once each):
    their KV and their tokens mean nothing to us. Workers compare their KV layouts' ids
    exactly (the weights' id, plus ``+<dtype>`` for a format whose KV differs, e.g.
    ``+int8``); a router, which only needs the same weights and tokenizer, passes
    `any_format` to take every format of its weights.

        async with WorkerDirectory(registry, role="decode") as directory:
            async for event in directory.events():
                ...
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        role: Role | None = None,
        poll_s: float = 0.5,
        max_staleness_s: float = 30.0,
        rejoin_grace_s: float = 5.0,
        model_id: str | None = None,
        any_format: bool = False,
    ) -> None:
        if poll_s <= 0:
            raise ValueError("poll_s must be > 0")
        if max_staleness_s <= 0:
            raise ValueError("max_staleness_s must be > 0")
        self.max_staleness_s = max_staleness_s
        # After polls failed (Redis away), a worker missing from the first answers is kept for
        # this long: a restarted, empty Redis has lost every lease, and each worker writes
        # its own again on its next heartbeat. Removing them meanwhile would close the
        # channels of streams that are still running fine.
        self.rejoin_grace_s = rejoin_grace_s
        self._poll_failed = False
        self._rejoin_until = 0.0
        self._registry = registry
        self._role: Role | None = role
        self.model_id = model_id
        self.any_format = any_format
        self._other_model: set[tuple[str, int]] = set()  # (worker id, epoch) said once
        self._poll_s = poll_s
        self._workers: dict[str, WorkerInfo] = {}
        self.generation = 0  # moves whenever the view may have changed (a poll replaced it)
        self._subscribers: set[asyncio.Queue[WorkerEvent | None]] = set()
        self._refreshed: list[Callable[[], None]] = []
        self._task: asyncio.Task[None] | None = None
        self.last_refresh = 0.0  # time.monotonic() of the last successful poll


    async def start(self) -> None:
        """Load the current workers (raises ControlPlaneError if Redis is down), then follow."""
        if self._task is not None:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._poll_loop(), name="worker-directory")

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)
        for queue in self._subscribers:
            queue.put_nowait(None)

    def staleness_s(self) -> float:
        """Seconds since the last successful poll (0 before the first)."""
        return time.monotonic() - self.last_refresh if self.last_refresh else 0.0

    @property
    def expired(self) -> bool:
        """No successful poll for longer than `max_staleness_s`: the view is not trusted."""
        return self.staleness_s() > self.max_staleness_s

    def snapshot(self) -> Mapping[str, WorkerInfo]:
        return MappingProxyType({} if self.expired else dict(self._workers))

    def get(self, worker_id: str) -> WorkerInfo | None:
        return None if self.expired else self._workers.get(worker_id)

    async def refresh(self) -> list[WorkerEvent]:
        """Poll once now; returns (and publishes) what changed."""
        try:
            listed = await self._registry.list_workers(self._role)
        except ControlPlaneError:
            self._poll_failed = True
            raise
        current = {w.worker_id: w for w in listed if self._same_model(w)}
        now = self.last_refresh = time.monotonic()
        if self._poll_failed:
            self._poll_failed = False
            self._rejoin_until = now + self.rejoin_grace_s
        events: list[WorkerEvent] = []
        for worker_id, gone in self._workers.items():
            if worker_id not in current:
                if now < self._rejoin_until:
                    current[worker_id] = gone  # may be re-writing its lease right now
                else:
                    events.append(WorkerEvent("removed", gone, gone))
        for worker_id, new in current.items():
            old = self._workers.get(worker_id)
            if old is None:
                events.append(WorkerEvent("added", new))
            elif old != new:
                events.append(WorkerEvent("updated", new, old))
        self._workers = current
        self.generation = generation = self.generation + 1
        for event in events:
            if event.kind != "updated" or event.restarted:
                log.info(
                    "worker_" + event.kind,
                    worker_id=event.worker.worker_id,
                    epoch=event.worker.epoch,
                    restarted=event.restarted,
                )
            for queue in self._subscribers:
                queue.put_nowait(event)
        for prepare in self._refreshed:
            await asyncio.sleep(0)  # each in a step of its own, requests going on between
            if self.generation != generation:
                break  # a later poll replaced the view meanwhile and runs them itself
            try:
                prepare()
            except Exception:  # a listener's bug must not stop the directory's polls
                log.exception("worker_directory_listener_failed")
        return events

    def on_refresh(self, prepare: Callable[[], None]) -> None:
        """Call `prepare()` after every successful poll, once the new view is in place: what
        its users derive from the view is built then, not by whoever reads it next. Each
        listener runs in an event-loop step of its own, so whoever reads the view in between
        finds it new and what `prepare` builds not yet built (it must build it then)."""
        self._refreshed.append(prepare)

    def _same_model(self, worker: WorkerInfo) -> bool:
        if self.model_id is None or worker.model_id == self.model_id or (
                self.any_format and worker.model_id.startswith(self.model_id + "+")):
            return True
        seen = (worker.worker_id, worker.epoch)
        if seen not in self._other_model:
            if len(self._other_model) >= 1024:  # bounded whatever is written into Redis
                self._other_model.clear()
            self._other_model.add(seen)
            log.warning("worker_ignored_other_model", worker_id=worker.worker_id,
                        model_id=worker.model_id, expected=self.model_id)
        return False

    async def events(self, *, known: bool = False) -> AsyncIterator[WorkerEvent]:
        """Changes from the first iteration on, in order; ends when the directory closes.
        With `known`, the workers known at that moment come first, each as "added"."""
        queue: asyncio.Queue[WorkerEvent | None] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            if known:
                for info in self.snapshot().values():
                    yield WorkerEvent("added", info)
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._subscribers.discard(queue)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            stale = self.expired
            try:
                await self.refresh()
            except ControlPlaneError as err:
                log.warning("worker_directory_poll_failed", error=str(err),
                            staleness_s=round(self.staleness_s(), 1),
                            expired=self.expired)
            else:
                if stale:
                    log.info("worker_directory_recovered", workers=len(self._workers))
