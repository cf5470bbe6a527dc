"""Driving a backend stream under a deadline while watching the client connection.

Invariant: whichever way a request ends (finished, client gone, timeout, error, server
shutdown), the backend's iterator is closed, which cancels the request on the workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.types import TokenEvent

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


async def aclose(it: AsyncIterator[TokenEvent]) -> None:
    """Close a backend stream (idempotent); this is what aborts the request downstream."""
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()


async def next_event(it: AsyncIterator[TokenEvent]) -> TokenEvent:
    return await anext(it)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def race(receive: Receive, work: Coroutine[Any, Any, T], deadline: float) -> T:
    """Await `work` until it finishes, the client disconnects (ClientDisconnected) or the loop
    clock passes `deadline` (TimeoutError). The losers are cancelled and awaited, so a
    cancelled backend stream has already run its cleanup when this returns."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait((task, gone), timeout=max(0.0, deadline - loop.time()),
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task in done:
        return task.result()
    if gone in done:
        raise ClientDisconnected
    raise TimeoutError


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its body and runs `cleanup`.

    Unlike Starlette's StreamingResponse it watches for the disconnect with plain asyncio
    (no anyio cancel scope): on disconnect the sending task is cancelled once, so the body
    and the backend stream beneath it can still await their cleanup (e.g. an abort RPC).
    The body is closed explicitly even if it was suspended at a `yield` or never started;
    then `cleanup` (which must be idempotent) runs.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], cleanup: Callable[[], Awaitable[None]],
                 headers: dict[str, str]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **headers})
        self._body = body
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((sender, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (sender, gone):
                t.cancel()
            await asyncio.gather(sender, gone, return_exceptions=True)
            await self._body.aclose()
            await self._cleanup()
        if sender.done() and not sender.cancelled() and (exc := sender.exception()) is not None:
            if not isinstance(exc, OSError):  # OSError: the client went away mid-send
                raise exc
