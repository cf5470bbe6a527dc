"""Driving a backend stream under a deadline while watching the client connection.

Invariant: whichever way a request ends (finished, client gone, timeout, error, server
shutdown), the backend's iterator is closed, which cancels the request on the workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.types import TokenEvent

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


class MergedStream:
    """The events of several backend streams, as they come, as one stream.

    Streams come in groups (the choices of one prompt): a group's first stream starts alone
    and the others start once it has produced its first event, i.e. once the prompt's KV is
    in the prefix cache, so they share its blocks instead of each prefilling the prompt.
    An error from any stream is raised from `__anext__`; `aclose()` closes every stream,
    which aborts the requests still running.
    """

    def __init__(self, groups: list[list[tuple[str, AsyncIterator[TokenEvent]]]]):
        """``groups``: per prompt, its (request id, stream) pairs; events are tagged with the
        request id of the stream they came from."""
        self._groups = groups
        self._queue: asyncio.Queue[TokenEvent | BaseException | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._live = sum(len(g) for g in groups)
        self._started = False
        self._closing = False

    def __aiter__(self) -> MergedStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if not self._started:
            self._started = True
            for group in self._groups:
                self._tasks.append(asyncio.ensure_future(self._pump(*group[0], group[1:])))
        while self._live:
            item = await self._queue.get()
            if item is None:
                self._live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return item
        raise StopAsyncIteration

    async def _pump(self, rid: str, it: AsyncIterator[TokenEvent],
                    followers: list[tuple[str, AsyncIterator[TokenEvent]]]) -> None:
        try:
            async for ev in it:
                if followers:
                    self._tasks.extend(asyncio.ensure_future(self._pump(*f, []))
                                       for f in followers)
                    followers = []
                if ev.request_id != rid:
                    ev = dataclasses.replace(ev, request_id=rid)
                self._queue.put_nowait(ev)
            self._queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._queue.put_nowait(exc)
        finally:
            if followers and not self._closing:  # the leader ended without an event
                self._tasks.extend(asyncio.ensure_future(self._pump(*f, [])) for f in followers)

    async def aclose(self) -> None:
        self._closing = True
        while True:
            pending = [t for t in self._tasks if not t.done()]
            if not pending:
                break
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for group in self._groups:
            for _, it in group:
                await aclose(it)
