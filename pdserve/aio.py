"""`async with` for the long-lived parts of a process (engine, router, Redis store, worker
directory, KV event publisher, KV sender and receiver): enter runs `start()`, leaving runs
`close()`. Imports nothing from the project."""

from __future__ import annotations

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
