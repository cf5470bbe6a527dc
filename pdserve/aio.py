"""`async with` for the long-lived parts of a process (engine, router, Redis store, worker
directory, KV event publisher, KV sender and receiver): enter runs `start()`, leaving runs
`close()`; and `TimeSlice`, for a long pass that shares the event loop. Imports nothing from
the project."""

from __future__ import annotations

import asyncio
import time
from typing import Self


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
