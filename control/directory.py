"""The router's live view of workers, following leases as they come and go."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Literal, Self

import structlog

from control.registry import ControlPlaneError, WorkerRegistry
from control.workers import Role, WorkerInfo

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


class WorkerDirectory:
    """Polls the registry every `poll_s`; a worker whose lease lapsed drops out on the next poll.

    `snapshot()` is always safe to read. If Redis is unreachable the last known view is kept
    (and `last_refresh` stops advancing) rather than routing to nobody.

        async with WorkerDirectory(registry, role="decode") as directory:
            async for event in directory.events():
                ...
    """

    def __init__(
        self, registry: WorkerRegistry, *, role: Role | None = None, poll_s: float = 0.5
    ) -> None:
        if poll_s <= 0:
            raise ValueError("poll_s must be > 0")
        self._registry = registry
        self._role: Role | None = role
        self._poll_s = poll_s
        self._workers: dict[str, WorkerInfo] = {}
        self._subscribers: set[asyncio.Queue[WorkerEvent | None]] = set()
        self._task: asyncio.Task[None] | None = None
        self.last_refresh = 0.0  # time.monotonic() of the last successful poll

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Load the current workers (raises ControlPlaneError if Redis is down), then follow."""
        if self._task is not None:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._poll_loop(), name="worker-directory")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for queue in self._subscribers:
            queue.put_nowait(None)

    def snapshot(self) -> Mapping[str, WorkerInfo]:
        return MappingProxyType(dict(self._workers))

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    async def refresh(self) -> list[WorkerEvent]:
        """Poll once now; returns (and publishes) what changed."""
        current = {w.worker_id: w for w in await self._registry.list_workers(self._role)}
        self.last_refresh = time.monotonic()
        events: list[WorkerEvent] = []
        for worker_id, gone in self._workers.items():
            if worker_id not in current:
                events.append(WorkerEvent("removed", gone, gone))
        for worker_id, new in current.items():
            old = self._workers.get(worker_id)
            if old is None:
                events.append(WorkerEvent("added", new))
            elif old != new:
                events.append(WorkerEvent("updated", new, old))
        self._workers = current
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
        return events

    async def events(self) -> AsyncIterator[WorkerEvent]:
        """Changes from the first iteration on, in order; ends when the directory closes."""
        queue: asyncio.Queue[WorkerEvent | None] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._subscribers.discard(queue)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                await self.refresh()
            except ControlPlaneError as err:
                log.warning("worker_directory_poll_failed", error=str(err))
