"""Pieces every pdserve process shares: logging set-up, stop signals, gRPC server start."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import grpc
import structlog


def configure_logging(level: str = "INFO", *, json: bool = True) -> None:
    """structlog to stderr: JSON lines by default; request ids come from contextvars."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def stop_event_on_signals(*signals: signal.Signals) -> asyncio.Event:
    """An event set on SIGTERM/SIGINT (or the given signals), for graceful shutdown."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals or (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def start_server(server: grpc.aio.Server, host: str, port: int) -> str:
    """Bind and start; returns the actual "host:port" (port 0 picks a free one)."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    await server.start()
    return f"{host}:{bound}"
