"""`router.liveness.until_lost`: a stream read in the consumer's task, ended when its worker is
lost and the stream silent, probed when silent; nothing created per event."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import AsyncIterator

import pytest

from pdserve.errors import WorkerLostError
from pdserve.types import TokenEvent
from router.liveness import until_lost

STALL_S = 0.1


async def stream(gaps: list[float], closed: list[bool]) -> AsyncIterator[TokenEvent]:
    """One event after each gap (s); `closed` records that the stream was closed."""
    try:
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            yield TokenEvent("r", i)
    finally:
        closed.append(True)


def lost_error() -> BaseException:
    return WorkerLostError("decode worker w is lost")


async def collect(lost: asyncio.Future[None], gaps: list[float], stalls: list[float],
                  closed: list[bool]) -> list[int | None]:
    got = []
    async for ev in until_lost(lost, stream(gaps, closed), lost_error, stall_s=STALL_S,
                               on_stall=lambda: stalls.append(time.monotonic())):
        got.append(ev.token_id)
    return got


async def test_events_pass_through_and_the_stream_is_closed() -> None:
    lost = asyncio.get_running_loop().create_future()
    stalls: list[float] = []
    closed: list[bool] = []
    assert await collect(lost, [0.0, 0.01, 0.0, 0.02], stalls, closed) == [0, 1, 2, 3]
    assert stalls == [] and closed == [True]
    assert not lost._callbacks  # type: ignore[attr-defined]  # its callback is removed


async def test_a_finished_stream_leaves_nothing_for_the_cyclic_gc() -> None:
    """The reading task is freed by its count once the stream is over: nothing of a request
    waits for a collection, which would pause every request on the loop."""
    lost = asyncio.get_running_loop().create_future()
    gc.collect()
    gc.disable()
    try:
        task = asyncio.create_task(collect(lost, [0.0, 0.0], [], []))
        assert await task == [0, 1]
        ref = weakref.ref(task)
        del task
        for _ in range(3):  # the loop's last callbacks let go of it
            await asyncio.sleep(0)
        assert ref() is None
    finally:
        gc.enable()


async def test_a_silent_stream_is_probed_once_per_stall() -> None:
    lost = asyncio.get_running_loop().create_future()
    stalls: list[float] = []
    closed: list[bool] = []
    started = time.monotonic()
    assert await collect(lost, [0.0, 2.5 * STALL_S], stalls, closed) == [0, 1]
    assert len(stalls) == 2
    assert stalls[0] - started >= STALL_S * 0.99
    assert stalls[1] - stalls[0] >= STALL_S * 0.99


async def test_lost_and_silent_ends_with_the_error_at_the_stall() -> None:
    loop = asyncio.get_running_loop()
    lost = loop.create_future()
    closed: list[bool] = []
    loop.call_later(0.02, lost.set_result, None)  # lost while the read waits, not yet silent
    started = time.monotonic()
    with pytest.raises(WorkerLostError):
        await collect(lost, [0.0, 10.0], [], closed)
    took = time.monotonic() - started
    assert STALL_S * 0.99 <= took < STALL_S + 0.5  # cut when the silence reached stall_s
    assert closed == [True]


async def test_lost_after_a_long_silence_cuts_at_once() -> None:
    loop = asyncio.get_running_loop()
    lost = loop.create_future()
    closed: list[bool] = []
    stalls: list[float] = []
    loop.call_later(2.5 * STALL_S, lost.set_result, None)  # the probes declare it lost
    started = time.monotonic()
    with pytest.raises(WorkerLostError):
        await collect(lost, [10.0], stalls, closed)
    assert time.monotonic() - started < 2.5 * STALL_S + 0.05  # at once, not a stall later
    assert len(stalls) == 2 and closed == [True]


async def test_a_lost_worker_still_delivering_goes_on() -> None:
    lost = asyncio.get_running_loop().create_future()
    lost.set_result(None)  # its lease lapsed, but it streams (starved of CPU, not dead)
    got = await collect(lost, [0.0] + [STALL_S / 4] * 6, [], [])
    assert got == list(range(7))


async def test_the_consumer_cancelled_is_a_cancellation_not_the_error() -> None:
    lost = asyncio.get_running_loop().create_future()
    closed: list[bool] = []
    task = asyncio.ensure_future(collect(lost, [0.0, 10.0], [], closed))
    await asyncio.sleep(0.02)
    lost.set_result(None)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == [True]


async def test_cut_and_cancelled_about_together_ends() -> None:
    """The stall timer's cut and the consumer's own cancellation close together: the task
    ends with one of them (which one is timing), and does not hang."""
    loop = asyncio.get_running_loop()
    lost = loop.create_future()
    lost.set_result(None)
    task = asyncio.ensure_future(collect(lost, [0.0, 10.0], [], []))
    await asyncio.sleep(STALL_S * 0.99)
    loop.call_later(STALL_S * 0.02, task.cancel)  # about when the stall timer cuts the read
    with pytest.raises((asyncio.CancelledError, WorkerLostError)):
        await task
    await asyncio.sleep(0)
    assert task.cancelled() or isinstance(task.exception(), WorkerLostError)
