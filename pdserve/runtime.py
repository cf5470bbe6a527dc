"""Pieces every pdserve process shares: logging set-up, stop signals, gRPC server start,
request-scoped log context, and the Prometheus endpoint of the workers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import signal
import socket
import ssl
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app, start_http_server
from prometheus_client.exposition import ThreadingWSGIServer

from pdserve.errors import InvalidRequestError
from pdserve.rpc.metadata import request_id_from_context
from pdserve.rpc.tls import TLSConfig
from pdserve.types import check_request_id

F = TypeVar("F", bound=Callable[..., Any])


def configure_logging(level: str = "INFO", *, json: bool = True) -> None:
    """structlog to stderr: JSON lines by default; request ids come from contextvars.
    ValueError for a level name logging does not know."""
    levels = logging.getLevelNamesMapping()
    if level.upper() not in levels:
        raise ValueError(f"invalid log level {level!r} (choose from DEBUG, INFO, WARNING, "
                         "ERROR, CRITICAL)")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            levels[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def stop_event_on_signals(*signals: signal.Signals,
                          exit_after_s: float | None = None) -> asyncio.Event:
    """An event set on SIGTERM/SIGINT (or the given signals), for graceful shutdown.

    With `exit_after_s`, the first signal also arms a watchdog thread: if the process is still
    alive that many seconds later (a drain stuck on a dead peer, a library thread that never
    ends), it exits with status 1 there and then, so a stop signal always stops the process
    within its drain grace. Repeated signals change nothing (a process group signal and a
    supervisor's own SIGTERM often both arrive)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            return
        stop.set()
        if exit_after_s is not None:
            timer = threading.Timer(exit_after_s, _hard_exit, args=("drain_grace_exceeded",))
            timer.daemon = True
            timer.start()

    for sig in signals or (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    return stop


class ListenError(OSError):
    """A listener could not bind its configured address. The process says so and exits 1
    (pdserve.services_cli), with no traceback: it is a setting or another process, not a
    bug."""


def _hard_exit(reason: str) -> None:
    structlog.get_logger(__name__).error("forced_exit", reason=reason)
    sys.stderr.flush()
    os._exit(1)


async def start_server(server: grpc.aio.Server, host: str, port: int,
                       credentials: grpc.ServerCredentials | None = None) -> str:
    """Bind and start; returns the actual "host:port" (port 0 picks a free one). With
    `credentials` (`pdserve.rpc.tls.TLSConfig.server_credentials`) the port speaks TLS only:
    nothing is served in plaintext."""
    address = f"{host}:{port}"
    try:
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
    except RuntimeError:  # grpcio's "Failed to bind", whatever the cause
        bound = 0
    if bound == 0:
        raise ListenError(f"cannot listen on {address} (gRPC): the port is in use, or the "
                          f"address is not one of this host's")
    await server.start()
    return f"{host}:{bound}"


# --------------------------------------------------------------------------- request context


def _request_id(request: Any, context: grpc.aio.ServicerContext) -> str:
    """The id to log: the caller's valid x-request-id, else the message's request_id when it
    is a valid id (an invalid one is refused by the handler, and never logged verbatim)."""
    rid = request_id_from_context(context) or getattr(request, "request_id", "")
    try:
        return check_request_id(rid) if isinstance(rid, str) and rid else ""
    except InvalidRequestError:
        return ""


def logs_request_id(method: F) -> F:
    """Servicer-method decorator: every log line emitted while the RPC runs (in its task or
    tasks it starts) carries ``request_id``, taken from the caller's ``x-request-id``
    metadata or else from the request message. Works for unary and streaming handlers."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            rid = _request_id(request, context)
            with structlog.contextvars.bound_contextvars(request_id=rid) if rid \
                    else contextlib.nullcontext():
                async for message in method(self, request, context):
                    yield message

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        rid = _request_id(request, context)
        with structlog.contextvars.bound_contextvars(request_id=rid) if rid \
                else contextlib.nullcontext():
            return await method(self, request, context)

    return unary  # type: ignore[return-value]


# --------------------------------------------------------------------------- metrics


# A TLS client gets this long to finish its handshake and to send each part of a request.
_TLS_IO_TIMEOUT_S = 10.0


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _TLSMetricsServer(ThreadingWSGIServer):
    """Prometheus text over TLS, the handshake done in each connection's own thread with a
    timeout: wrapping the listening socket would handshake inside accept(), so one client
    that connects and says nothing would stall every scrape."""

    context: ssl.SSLContext

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        sock.settimeout(_TLS_IO_TIMEOUT_S)
        return self.context.wrap_socket(sock, server_side=True,
                                        do_handshake_on_connect=False), addr

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.do_handshake()  # a plaintext or unknown client ends here (handle_error)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # refused handshakes and dropped clients are not worth a traceback


def _start_tls_metrics(registry: CollectorRegistry, host: str, port: int,
                       tls: TLSConfig) -> tuple[WSGIServer, threading.Thread]:
    class Server(_TLSMetricsServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        context = tls.server_context("require")

    httpd: WSGIServer = make_server(host, port, make_wsgi_app(registry), Server,
                                    handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-tls", daemon=True)
    thread.start()
    return httpd, thread


@contextlib.contextmanager
def metrics_server(registry: CollectorRegistry, host: str, port: int,
                   tls: TLSConfig | None = None) -> Iterator[int | None]:
    """Serve ``registry`` as Prometheus text on ``http://host:port/metrics`` (any path works)
    from a daemon thread; yields the bound port (``port=0`` picks a free one), or None
    without serving when ``port`` is negative. Collectors run on that thread, so they must
    only read state. The server is shut down on exit. With `tls`: HTTPS only, and only for
    clients with a certificate from its CA (a worker's rule for every listener)."""
    if port < 0:
        yield None
        return
    try:
        httpd, thread = (start_http_server(port, addr=host, registry=registry) if tls is None
                         else _start_tls_metrics(registry, host, port, tls))
    except ssl.SSLError:
        raise  # its certificate or key, not the address
    except OSError as exc:  # the address taken or not this host's (gaierror included)
        raise ListenError(f"cannot listen on {host}:{port} (metrics): {exc.strerror or exc}"
                          ) from exc
    try:
        yield int(httpd.server_port)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
