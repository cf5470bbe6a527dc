"""Where an asyncio test waits when it runs into its timeout.

pytest-timeout prints every thread's stack, and for a test on the session's event loop that
shows only the loop waiting in select, not which await never ends. Shortly before a test's
timeout (`REPORT_BEFORE_S`), every task on the loop prints its stack (to the test's captured
stderr, shown with the failure). The printing runs on the loop itself, scheduled from a timer
thread, so it reads no task while the loop runs it. Wired up in tests/conftest.py."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator

import pytest

from pdserve.aio import awaiting

REPORT_BEFORE_S = 20.0

_loop: asyncio.AbstractEventLoop | None = None


def watch_loop(loop: asyncio.AbstractEventLoop) -> None:
    global _loop
    _loop = loop


def _print_tasks() -> None:
    tasks = asyncio.all_tasks()
    print(f"\n+++ {len(tasks)} asyncio tasks near the test's timeout +++", file=sys.stderr)
    for task in tasks:
        print(f"--- {task.get_name()}: {task!r}", file=sys.stderr)
        print("\n".join(awaiting(task)), file=sys.stderr)


def _timeout_s(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:
        return 0.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    timeout_s = _timeout_s(item)
    timer = None
    if timeout_s > 2 * REPORT_BEFORE_S:
        def report() -> None:
            loop = _loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(_print_tasks)
        timer = threading.Timer(timeout_s - REPORT_BEFORE_S, report)
        timer.daemon = True
        timer.start()
    try:
        return (yield)
    finally:
        if timer is not None:
            timer.cancel()
