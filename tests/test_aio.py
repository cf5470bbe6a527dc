"""pdserve.aio.stop_task: a close always ends. A task that ends when cancelled is waited for
(an exception it ended with is raised); one that swallows its cancellation, or waits on
something that cannot be cancelled (redis-py's PubSub.aclose), is logged with where it waits
and left after the bound, never waited on for ever. And the router's in-flight follower
(pdserve.control.inflight) ends within its bound when redis-py's subscription teardown stalls."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import structlog
from redis.asyncio.client import PubSub

from pdserve.aio import stop_task
from pdserve.control import WorkerRegistry
from pdserve.control.inflight import InflightBoard, new_router_id


async def test_a_task_that_ends_when_cancelled_is_waited_for() -> None:
    task = asyncio.create_task(asyncio.sleep(60))
    await stop_task(task, timeout_s=5)
    assert task.cancelled()
    await stop_task(None)


async def test_what_a_task_ended_with_is_raised() -> None:
    async def crash() -> None:
        raise ValueError("a bug")
    task = asyncio.create_task(crash())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="a bug"):
        await stop_task(task)


async def test_a_task_that_swallows_its_cancellation_is_logged_and_left() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            pass  # swallowed: the bug stop_task must survive
        await release.wait()
    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    t0 = asyncio.get_running_loop().time()
    with structlog.testing.capture_logs() as logs:
        await stop_task(task, timeout_s=0.2)
    assert asyncio.get_running_loop().time() - t0 < 2.0
    assert not task.done()
    [line] = [e for e in logs if e["event"] == "task_did_not_stop"]
    assert line["task"] == "stubborn" and "in stubborn" in line["stack"]
    release.set()
    await task


async def test_the_inflight_follower_ends_when_the_subscription_teardown_stalls(
        redis_server: str, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As redis-py's PubSub.aclose does, the stand-in waits for a teardown however often it
    is cancelled; the teardown never ends here. The follower still ends within the
    registry's op_timeout_s of being cancelled (before this change it waited for ever, and
    so did the router closing it)."""
    never = asyncio.get_running_loop().create_future()
    stalled = asyncio.Event()

    async def aclose(self: PubSub) -> None:
        stalled.set()
        while not never.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(never)
    monkeypatch.setattr(PubSub, "aclose", aclose)
    async with WorkerRegistry.from_url(redis_server, namespace=namespace,
                                       op_timeout_s=0.3) as registry:
        board = InflightBoard(registry, new_router_id())
        follow = asyncio.create_task(board.follow(lambda counts: None))
        await asyncio.sleep(0.2)  # subscribed, reading
        t0 = asyncio.get_running_loop().time()
        with structlog.testing.capture_logs() as logs:
            await stop_task(follow, timeout_s=5)
        assert follow.done() and stalled.is_set()
        assert asyncio.get_running_loop().time() - t0 < 2.0
        assert not [e for e in logs if e["event"] == "task_did_not_stop"]
    never.cancel()  # the teardown left behind ends too
    await asyncio.sleep(0.05)
