"""The prefill worker's gate: which prompts may compute (or send their KV) at once.

`GateQueue` is the rule alone, with no event loop, so the cluster simulator (bench/sim)
admits its simulated prompts by this code and not a copy of it; `PriorityGate` is the
asyncio gate the worker holds around each request.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class GateQueue(Generic[T]):
    """At most ``limit`` holders at once, and one more per class: a request whose class holds
    no slot while a worse class holds one enters at once, so an interactive prompt does not
    wait for a gate full of batch prompts (at most ``limit`` + the number of classes - 1
    hold slots). Waiters are admitted by (priority, arrival); a lower priority is better."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0
        self._held: collections.Counter[int] = collections.Counter()  # holders by priority
        self._waiters: list[tuple[int, int, T]] = []
        self._counter = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def _may_enter(self, priority: int) -> bool:
        if self.active < self.limit:
            return True
        return not self._held[priority] and any(
            p > priority for p, n in self._held.items() if n)

    def _enter(self, priority: int) -> None:
        self.active += 1
        self._held[priority] += 1

    def try_enter(self, priority: int, waiter: T) -> bool:
        """Take a slot now (True), or queue `waiter` for one (False). Behind a waiter of its
        class or a better one, a request waits its turn."""
        if (self._waiters and self._waiters[0][0] <= priority) or not self._may_enter(priority):
            heapq.heappush(self._waiters, (priority, next(self._counter), waiter))
            return False
        self._enter(priority)
        return True

    def remove(self, waiter: T) -> bool:
        """Forget a queued waiter (it gave up); False if it is not queued."""
        return self.remove_where(lambda w: w is waiter) is not None

    def remove_where(self, match: Callable[[T], bool]) -> T | None:
        """Forget the first queued waiter `match` accepts (it gave up) and return it; None
        if none is queued."""
        for i, entry in enumerate(self._waiters):
            if match(entry[2]):
                self._waiters.pop(i)
                heapq.heapify(self._waiters)
                return entry[2]
        return None

    def release(self, priority: int, gone: Callable[[T], bool] = lambda _: False) -> list[T]:
        """A holder of `priority` leaves. Returns the waiters granted a slot in its place, in
        order (the slot is theirs on the grant); waiters for which `gone` is true are
        dropped unserved."""
        self.active -= 1
        self._held[priority] -= 1
        granted = []
        while self._waiters:
            prio, _, waiter = self._waiters[0]
            if gone(waiter):
                heapq.heappop(self._waiters)
                continue
            if not self._may_enter(prio):
                break
            heapq.heappop(self._waiters)
            self._enter(prio)
            granted.append(waiter)
        return granted


class PriorityGate:
    """`GateQueue`'s rule around an async block: ``async with gate.slot(priority):``."""

    def __init__(self, limit: int):
        self._queue: GateQueue[asyncio.Future[None]] = GateQueue(limit)
        self.queued_tokens = 0

    @property
    def limit(self) -> int:
        return self._queue.limit

    @property
    def active(self) -> int:
        return self._queue.active

    @property
    def num_waiting(self) -> int:
        return self._queue.num_waiting

    @asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self._queue.try_enter(priority, fut):
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._release(priority)  # we were granted the slot just as we were cancelled
                else:
                    self._queue.remove(fut)  # a release may already have dropped it
                raise
        try:
            yield
        finally:
            self._release(priority)

    def _release(self, priority: int) -> None:
        for fut in self._queue.release(priority, gone=lambda f: f.done()):
            fut.set_result(None)
