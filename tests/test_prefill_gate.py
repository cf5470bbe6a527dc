"""The prefill worker's gate on its own (`prefill_svc.gate.PriorityGate`): at most `limit`
holders, and one more per class that holds none while a worse one does; waiters by class,
then arrival. Plain asyncio, no engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from pdserve.types import LatencyClass
from prefill_svc.gate import GateQueue, PriorityGate

INTERACTIVE = LatencyClass.INTERACTIVE.priority
STANDARD = LatencyClass.STANDARD.priority
BATCH = LatencyClass.BATCH.priority


class Holders:
    """Requests holding (or waiting for) a gate's slots until told to leave."""

    def __init__(self, gate: PriorityGate) -> None:
        self.gate = gate
        self.entered: list[str] = []
        self._leave: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, priority: int) -> None:
        self._leave[name] = asyncio.Event()

        async def hold() -> None:
            async with self.gate.slot(priority):
                self.entered.append(name)
                await self._leave[name].wait()

        self._tasks[name] = asyncio.create_task(hold())

    async def leave(self, name: str) -> None:
        self._leave[name].set()
        await self._tasks[name]

    def cancel(self, name: str) -> asyncio.Task[None]:
        self._tasks[name].cancel()
        return self._tasks[name]


@contextlib.asynccontextmanager
async def holders(limit: int) -> AsyncIterator[Holders]:
    h = Holders(PriorityGate(limit))
    try:
        yield h
    finally:
        for task in h._tasks.values():
            task.cancel()
        await asyncio.gather(*h._tasks.values(), return_exceptions=True)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_better_class_enters_past_a_gate_full_of_worse_ones() -> None:
    async with holders(2) as h:
        h.start("b1", BATCH)
        h.start("b2", BATCH)
        await settle()
        h.start("b3", BATCH)  # full: waits
        h.start("s1", STANDARD)  # no standard holds a slot, batch does: in
        h.start("i1", INTERACTIVE)  # no interactive holds one: in
        await settle()
        assert h.entered == ["b1", "b2", "s1", "i1"] and h.gate.active == 4
        h.start("i2", INTERACTIVE)  # its class holds one: waits, ahead of b3
        h.start("s2", STANDARD)  # waits too, behind i2 (a better class waiting)
        await settle()
        assert h.gate.num_waiting == 3
        await h.leave("b1")  # 3 holders, still over the limit: nobody enters
        await settle()
        assert h.entered == ["b1", "b2", "s1", "i1"]
        await h.leave("i1")  # the interactive class holds none now: i2 takes one
        await settle()
        assert h.entered[-1] == "i2" and h.gate.num_waiting == 2
        await h.leave("s1")  # s2 takes the standard class's
        await settle()
        assert h.entered[-1] == "s2" and h.gate.active == 3
        for name in ("b2", "s2"):
            await h.leave(name)
        await settle()  # under the limit: b3 at last
        assert h.entered[-1] == "b3" and h.gate.active == 2
        for name in ("i2", "b3"):
            await h.leave(name)
        assert h.gate.active == 0 and h.gate.num_waiting == 0


async def test_waiters_by_class_then_arrival_and_a_cancelled_waiter_takes_nothing() -> None:
    async with holders(1) as h:
        h.start("i0", INTERACTIVE)
        await settle()
        for name, priority in (("b1", BATCH), ("s1", STANDARD), ("s2", STANDARD),
                               ("i1", INTERACTIVE)):
            h.start(name, priority)
        await settle()
        assert h.entered == ["i0"] and h.gate.num_waiting == 4
        task = h.cancel("s1")
        with pytest.raises(asyncio.CancelledError):
            await task
        for name in ("i0", "i1", "s2"):  # each leaving lets the best waiter in
            await h.leave(name)
            await settle()
        assert h.entered == ["i0", "i1", "s2", "b1"]
        await h.leave("b1")
        assert h.gate.active == 0 and h.gate.num_waiting == 0


def test_the_rule_alone_grants_slots_on_release_and_drops_waiters_that_left() -> None:
    """`GateQueue` (what the simulator runs): no event loop, the waiters are any objects."""
    q: GateQueue[str] = GateQueue(1)
    assert q.try_enter(BATCH, "b1")
    assert not q.try_enter(BATCH, "b2") and not q.try_enter(BATCH, "b3")
    assert q.try_enter(INTERACTIVE, "i1")  # its class holds none, a worse one does
    assert q.try_enter(STANDARD, "s1")  # so does standard; the waiters are worse: in
    assert q.active == 3 and q.num_waiting == 2
    assert q.release(INTERACTIVE) == [] and q.release(STANDARD) == []  # still b1 at the limit
    assert q.remove("b2") and not q.remove("b2")
    assert q.release(BATCH, gone=lambda w: w == "b3") == [] and q.num_waiting == 0
    assert q.try_enter(BATCH, "b4") and q.active == 1
