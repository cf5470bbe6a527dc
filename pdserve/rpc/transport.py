"""gRPC transport: channel and server options that match, the server every service runs
(`ErrorInterceptor` first), plaintext and TLS channels, and grpc.health.v1."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as _health_aio

from pdserve.rpc.errors import ErrorInterceptor
from pdserve.rpc.tls import TLSConfig

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # channels, and servers told no smaller limit
KEEPALIVE_MS = 30_000  # how often our channels ping an idle connection
# Pings a server takes more often than half our keepalive before it sends GOAWAY
# (ENHANCE_YOUR_CALM "too_many_pings") and closes the connection; grpc's own default.
MAX_PING_STRIKES = 2


def _shared_options(max_message_bytes: int, keepalive_ms: int) -> list[tuple[str, int]]:
    """Message limits and keepalive pings, the same on both ends."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def channel_options(
    *, max_message_bytes: int = MAX_MESSAGE_BYTES, keepalive_ms: int = KEEPALIVE_MS
) -> list[tuple[str, int]]:
    """Client channel options: big messages, keepalive pings that detect dead peers."""
    return [*_shared_options(max_message_bytes, keepalive_ms),
            ("grpc.http2.max_pings_without_data", 0)]


def server_options(
    *, max_message_bytes: int = MAX_MESSAGE_BYTES, keepalive_ms: int = KEEPALIVE_MS,
    max_ping_strikes: int = MAX_PING_STRIKES, bdp_probe: int = 0,
) -> list[tuple[str, int]]:
    """Server options matching `channel_options`: takes their pings (one per `keepalive_ms`,
    allowed down to half that), and GOAWAYs a peer that pings faster more than
    `max_ping_strikes` times; refuses a message over `max_message_bytes` (RESOURCE_EXHAUSTED).

    Without `bdp_probe` the server keeps HTTP/2's default receive window (64 KiB a stream)
    instead of letting grpc's bandwidth-delay probe grow it to megabytes: a caller can then
    push at most a window's worth into a worker before the credential check refuses its call
    (8 unauthenticated 16 MiB messages cost a worker 13-29 MB of RSS with the probe, ~1.3 MB
    without: tests/test_grpc_bounds.py). Our requests are at most ~1 MiB and travel between
    hosts of one cluster; what the small window costs them is in docs/BENCHMARKS.md."""
    return [*_shared_options(max_message_bytes, keepalive_ms),
            ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2),
            ("grpc.http2.max_ping_strikes", max_ping_strikes),
            ("grpc.http2.bdp_probe", 1 if bdp_probe else 0)]


def insecure_channel(target: str, *, interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
                     **options: int) -> grpc.aio.Channel:
    """A plaintext channel with `channel_options(**options)`; the caller owns it (`async with`)."""
    return grpc.aio.insecure_channel(target, options=channel_options(**options),
                                     interceptors=list(interceptors) or None)


def channel(target: str, *, tls: TLSConfig | None = None,
            interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
            **options: int) -> grpc.aio.Channel:
    """`insecure_channel`, or with `tls` a TLS channel that trusts its CA only and presents
    its certificate (mTLS where the server asks for one); the caller owns it."""
    if tls is None:
        return insecure_channel(target, interceptors=interceptors, **options)
    opts: list[tuple[str, int | str]] = [*channel_options(**options), *tls.channel_options()]
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=opts,
                                   interceptors=list(interceptors) or None)


def new_server(*interceptors: grpc.aio.ServerInterceptor,
               auth: grpc.aio.ServerInterceptor | None = None,
               stamp: grpc.aio.ServerInterceptor | None = None,
               max_concurrent_rpcs: int | None = None, **options: int) -> grpc.aio.Server:
    """A grpc.aio server with `server_options(**options)`: `auth` (see `pdserve.rpc.auth`)
    first, so an unauthenticated call is refused before anything else looks at it, then
    `ErrorInterceptor`, then `interceptors`. `stamp`, an interceptor that only notes when a
    call arrived (`router.timings.ArrivalInterceptor`), goes before `auth`. With
    `max_concurrent_rpcs`, a call arriving while that many are in progress (any caller, any
    method) is answered RESOURCE_EXHAUSTED without running its handler."""
    first = [i for i in (stamp, auth) if i is not None]
    return grpc.aio.server(
        interceptors=[*first, ErrorInterceptor(), *interceptors], options=server_options(**options),
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )


HealthServicer = _health_aio.HealthServicer  # the asyncio grpc.health.v1 servicer


async def add_health(server: grpc.aio.Server, *services: str) -> HealthServicer:
    """Register grpc.health.v1 on `server`; "" (overall) and `services` start NOT_SERVING.

    Call `set_serving` once the service can take requests (model loaded, registered), and
    `health.enter_graceful_shutdown()` on SIGTERM before `server.stop(grace)`.
    """
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await set_not_serving(health, *services)
    return health


async def set_serving(health: HealthServicer, *services: str) -> None:
    """Mark "" (overall) and `services` SERVING."""
    for service in ("", *services):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)


async def set_not_serving(health: HealthServicer, *services: str) -> None:
    """Mark "" (overall) and `services` NOT_SERVING (draining, or not ready yet)."""
    for service in ("", *services):
        await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
