"""`async with` for the long-lived parts of a process (engine, router, Redis store, worker
directory, KV event publisher, KV sender and receiver): enter runs `start()`, leaving runs
`close()`; `stop_task`, which ends a background task within a bound (`awaiting`: where a
task waits); and `TimeSlice`, for a long pass that shares the event loop. Imports nothing
from the project."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Self

import structlog

log = structlog.get_logger(__name__)

STOP_TIMEOUT_S = 5.0  # how long `stop_task` waits for a cancelled task to end


class AsyncResource:
    """Subclasses define `close()` (idempotent, never raises for an unreachable peer) and, if
    they have something to start, `start()`."""

    async def start(self) -> None:
        """Nothing to start by default."""

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def stop_task(task: asyncio.Task[Any] | None, *,
                    timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Cancel `task` and wait, at most `timeout_s`, for it to end; an exception it ended with
    (other than its cancellation) is raised here. A task still running after `timeout_s`
    swallowed its cancellation or waits on something that cannot be cancelled (redis-py's
    `PubSub.aclose` waits for its teardown however often it is cancelled): it is logged,
    with where it waits, and left, never waited on for ever. A `close()` ends."""
    if task is None:
        return
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        log.error("task_did_not_stop", task=task.get_name(), waited_s=timeout_s,
                  stack="\n".join(awaiting(task)))
        return
    if not task.cancelled() and (err := task.exception()) is not None:
        raise err


def awaiting(task: asyncio.Task[Any]) -> list[str]:
    """Where `task` waits, outermost first: its coroutine's frame and that of each coroutine
    or async generator it awaits in turn (`Task.print_stack` shows only the first)."""
    where: list[str] = []
    obj: object = task.get_coro()
    while obj is not None and len(where) < 40:
        frame = (getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None)
                 or getattr(obj, "gi_frame", None))
        if frame is not None:
            where.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        obj = (getattr(obj, "cr_await", None) or getattr(obj, "ag_await", None)
               or getattr(obj, "gi_yieldfrom", None))
    return where


class TimeSlice:
    """A long pass over many items that shares the event loop with requests (the router's
    metrics page): `await slice.step()` after each item yields to the loop once `budget_s`
    has passed since the pass began or last yielded, so none of its steps holds the loop
    much longer than that, however costly its items are. A request that arrives meanwhile
    waits for the step that is running, not for the pass. Not for a pass that runs several
    times a second: slicing the worker listing so made the requests' own steps slower in
    their tail (docs/BENCHMARKS.md, stop 57)."""

    def __init__(self, budget_s: float = 0.0002) -> None:
        self.budget_s = budget_s
        self._since = time.perf_counter()

    async def step(self) -> None:
        if time.perf_counter() - self._since >= self.budget_s:
            await asyncio.sleep(0)
            self._since = time.perf_counter()
