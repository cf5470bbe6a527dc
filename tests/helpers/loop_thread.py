"""Serve something async from a private event loop on a thread, for synchronous clients.

Fuzzers (hypothesis, schemathesis) drive their examples synchronously; the servers they test
(uvicorn, grpc.aio, AsyncEngine) need a running loop. `serve_in_thread` gives them one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def serve_in_thread(factory: Callable[[], AbstractAsyncContextManager[T]],
                    start_timeout_s: float = 300.0) -> Iterator[T]:
    """Enter ``factory()`` on a new loop in a daemon thread and yield what it gives; on exit,
    leave it on that loop (so its cleanup runs where it started) and stop the thread."""
    loop = asyncio.new_event_loop()
    entered: concurrent.futures.Future[T] = concurrent.futures.Future()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            async with factory() as value:
                entered.set_result(value)
                await stop.wait()
        except BaseException as exc:
            if not entered.done():
                entered.set_exception(exc)
            raise

    def run() -> None:
        asyncio.set_event_loop(loop)
        with contextlib.suppress(BaseException):  # reported through `entered`
            loop.run_until_complete(main())

    thread = threading.Thread(target=run, name="serve-in-thread", daemon=True)
    thread.start()
    try:
        yield entered.result(timeout=start_timeout_s)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=60)
        if not thread.is_alive():
            loop.close()
