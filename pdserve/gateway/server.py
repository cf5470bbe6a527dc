"""Running the gateway app with uvicorn inside the caller's event loop.

The hosting process (e.g. the router) owns signals: it passes `serve` a stop event (see
`pdserve.runtime.stop_event_on_signals`), and on stop uvicorn stops accepting connections and
gives in-flight requests `graceful_shutdown_s` to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from typing import Any

import structlog
import uvicorn
from starlette.types import ASGIApp

from pdserve.rpc.tls import TLSConfig

log = structlog.get_logger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # signals belong to the hosting process


def make_server(app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *,
                log_level: str = "warning", graceful_shutdown_s: int = 10,
                tls: TLSConfig | None = None) -> uvicorn.Server:
    """A uvicorn.Server for `app` that leaves signals to the hosting process. Drive it
    yourself: ``task = create_task(server.serve())``, poll ``server.started``, then set
    ``server.should_exit = True`` and await the task to stop gracefully. With `tls` it
    serves HTTPS only (client certificates as ``tls.client_auth`` says)."""
    ssl: dict[str, Any] = {} if tls is None else tls.uvicorn_options()
    # log_config=None: leave the process's logging configuration alone.
    config = uvicorn.Config(app, host=host, port=port, log_config=None, log_level=log_level,
                            access_log=False, lifespan="off",
                            timeout_graceful_shutdown=graceful_shutdown_s, **ssl)
    return _Server(config)


class GatewayServer:
    """One uvicorn server on a socket bound at `start()` (`port=0` picks a free port)."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *,
                 log_level: str = "warning", graceful_shutdown_s: int = 10,
                 startup_timeout_s: float = 10.0, tls: TLSConfig | None = None):
        self.app = app
        self.tls = tls
        self.host = host
        self.port = port
        self._log_level = log_level
        self._graceful_shutdown_s = graceful_shutdown_s
        self._startup_timeout_s = startup_timeout_s
        self._sock: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"{'http' if self.tls is None else 'https'}://{self.host}:{self.port}"

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self._sock, self.port = sock, sock.getsockname()[1]
        server = self._server = make_server(self.app, self.host, self.port,
                                            log_level=self._log_level,
                                            graceful_shutdown_s=self._graceful_shutdown_s,
                                            tls=self.tls)
        task = self._task = asyncio.create_task(server.serve(sockets=[sock]),
                                                name=f"gateway:{self.port}")
        try:
            async with asyncio.timeout(self._startup_timeout_s):
                while not server.started:
                    if task.done():
                        task.result()  # raises the startup failure
                        raise RuntimeError("the gateway server exited during startup")
                    await asyncio.sleep(0.01)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), close the socket."""
        if self._server is not None:
            self._server.should_exit = True
        try:
            if self._task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._task, self._graceful_shutdown_s + 5.0)
        finally:
            self._task = self._server = None
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    async def __aenter__(self) -> GatewayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def serve(app: ASGIApp, host: str = "127.0.0.1", port: int = 8000, *,
                stop: asyncio.Event | None = None, log_level: str = "info",
                graceful_shutdown_s: int = 10, tls: TLSConfig | None = None) -> None:
    """Serve `app` until `stop` is set, or until cancelled; then shut down gracefully."""
    async with GatewayServer(app, host, port, log_level=log_level,
                             graceful_shutdown_s=graceful_shutdown_s, tls=tls) as server:
        log.info("gateway listening", url=server.url)
        await (stop.wait() if stop is not None else asyncio.Future())


def running_server(app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *,
                   tls: TLSConfig | None = None) -> GatewayServer:
    """For tests and tools: ``async with running_server(app) as srv: ... srv.url``."""
    return GatewayServer(app, host, port, graceful_shutdown_s=5, tls=tls)
