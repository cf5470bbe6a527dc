"""Running the gateway app with uvicorn inside the caller's event loop.

`serve` is what a process (e.g. the router) awaits alongside its other services;
`running_server` starts one on a free port for tests and tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp


class _Server(uvicorn.Server):
    """uvicorn.Server that can leave signal handling to the hosting process."""

    def __init__(self, config: uvicorn.Config, *, handle_signals: bool):
        super().__init__(config)
        self._handle_signals = handle_signals

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if self._handle_signals:
            with super().capture_signals():
                yield
        else:
            yield


def _config(app: ASGIApp, host: str, port: int, *, log_level: str,
            graceful_shutdown_s: int) -> uvicorn.Config:
    # log_config=None: leave the process's logging configuration alone.
    return uvicorn.Config(app, host=host, port=port, log_config=None, log_level=log_level,
                          access_log=False, lifespan="off",
                          timeout_graceful_shutdown=graceful_shutdown_s)


async def serve(app: ASGIApp, host: str = "127.0.0.1", port: int = 8000, *,
                log_level: str = "info", graceful_shutdown_s: int = 10,
                handle_signals: bool = True) -> None:
    """Serve `app` until SIGINT/SIGTERM (if `handle_signals`) or until cancelled.

    On a signal, uvicorn stops accepting connections and waits up to `graceful_shutdown_s`
    for in-flight requests before cancelling them.
    """
    server = _Server(_config(app, host, port, log_level=log_level,
                             graceful_shutdown_s=graceful_shutdown_s),
                     handle_signals=handle_signals)
    await server.serve()


@dataclass(frozen=True)
class RunningServer:
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextlib.asynccontextmanager
async def running_server(app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *,
                         graceful_shutdown_s: int = 5,
                         startup_timeout_s: float = 10.0) -> AsyncIterator[RunningServer]:
    """Serve `app` in a background task for the duration of the block. `port=0` picks a free
    port (the socket is bound here, so there is no race for it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    actual_port = sock.getsockname()[1]
    server = _Server(_config(app, host, actual_port, log_level="warning",
                             graceful_shutdown_s=graceful_shutdown_s),
                     handle_signals=False)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"gateway:{actual_port}")
    try:
        async with asyncio.timeout(startup_timeout_s):
            while not server.started:
                if task.done():
                    task.result()  # raises the startup failure
                    raise RuntimeError("the gateway server exited during startup")
                await asyncio.sleep(0.01)
        yield RunningServer(host, actual_port)
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, graceful_shutdown_s + 5.0)
        finally:
            sock.close()
