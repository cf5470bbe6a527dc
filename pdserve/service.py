"""The one lifecycle every pdserve service runs: the router and both kinds of worker.

    serving(...)      health NOT_SERVING, bind, start the gRPC server  -> Service (.bound)
    (the role's own start-up: build its worker record, start its HTTP gateway, ...)
    Service.run(...)  register           (a worker's lease; the role's callable)
                      health SERVING, log "<name>_ready", set `ready`
                      wait for `stop`
                      log "<name>_draining"
                      deregister         (one bounded attempt: a dead Redis is logged as
                                          "deregister_failed", the lease lapses by itself)
                      health NOT_SERVING
                      linger             (still serving, while routers notice we left)
                      drain              (in-flight work, within `Drain.timeout_s`)
                      server.stop(grace) (the rest of that budget, at least `min_grace_s`)
    (the role's own clean-up; it logs "<name>_stopped" once everything is released)

One drain budget per process: the in-flight work and the gRPC server's grace share
`Drain.timeout_s`, so a stop signal ends the process within it (plus `linger_s` and
`min_grace_s`), inside the watchdog `pdserve.runtime.stop_event_on_signals` arms.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

import grpc
import structlog

from pdserve.errors import ControlPlaneError
from pdserve.rpc import transport
from pdserve.runtime import start_server

log = structlog.get_logger(__name__)

Fields = Mapping[str, object]


NO_GC_FREEZE_ENV = "PDSERVE_NO_GC_FREEZE"


def freeze_startup_heap() -> None:
    """Take what start-up allocated out of the cyclic GC's walks (`gc.freeze`, after one
    full collection so no garbage is kept). A service imports torch and builds its
    tokenizer, engine or index first: ~370,000 tracked objects in a router, which every
    full collection walked again, a ~170 ms pause every few seconds of load for every
    request in the process (bench.router_harness, 64 workers). Objects made later are
    collected as before. `PDSERVE_NO_GC_FREEZE=1` leaves the heap as it is (to measure
    what this saves: bench/gc_trace)."""
    if os.environ.get(NO_GC_FREEZE_ENV):
        return
    gc.collect()
    gc.freeze()


@dataclass(frozen=True)
class Drain:
    """How a stopping service lets its work finish.

    `work(budget_s)` waits for the service's in-flight work for at most `budget_s` seconds
    (`timeout_s`); then the gRPC server stops with whatever is left of `timeout_s` as its
    grace, at least `min_grace_s`, so calls still running get that long before they are
    cancelled. `linger_s` is spent before the budget starts, serving as usual after
    deregistering: requests routed here before the routers' next directory poll still land
    on a server that takes them."""

    timeout_s: float
    work: Callable[[float], Awaitable[object]] | None = None
    linger_s: float = 0.0
    min_grace_s: float = 0.5


class Service:
    """A started gRPC server with its health service, run by `run` from ready to stopped.

    Made by `serving`, which owns the server: leaving its block stops the server at once if
    `run` did not get to stop it gracefully (an error on the way)."""

    def __init__(self, name: str, server: grpc.aio.Server, health: transport.HealthServicer,
                 health_service: str, bound: str) -> None:
        self.name = name  # log events are "<name>_ready" and "<name>_draining"
        self.server = server
        self.bound = bound  # "host:port" the server listens on (the port it really got)
        self._health = health
        self._health_service = health_service
        self._stopped = False

    @property
    def port(self) -> str:
        return self.bound.rpartition(":")[2]

    def advertised(self, host: str) -> str:
        """The address others dial: `host` (an advertised host) with the bound port."""
        return f"{host}:{self.port}"

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None, drain: Drain, *,
                  register: Callable[[], Awaitable[object]] | None = None,
                  deregister: Callable[[], Awaitable[object]] | None = None,
                  ready_fields: Fields | None = None,
                  draining_fields: Callable[[], Fields] | None = None) -> None:
        """Serve until `stop` is set, then drain and stop the server (the module docstring
        has the order). `register` runs before the service reports SERVING (an error there
        propagates: the service never became ready); `deregister` is the first thing done
        on stop. `ready_fields` and `draining_fields()` go into the ready and draining log
        lines."""
        if register is not None:
            await register()
        freeze_startup_heap()
        await transport.set_serving(self._health, self._health_service)
        log.info(f"{self.name}_ready", **(ready_fields or {}))
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info(f"{self.name}_draining",
                 **(draining_fields() if draining_fields is not None else {}))
        if deregister is not None:
            try:  # a dead Redis costs one bounded attempt; the lease lapses within its TTL
                await deregister()
            except ControlPlaneError as err:
                log.warning("deregister_failed", error=str(err))
        await transport.set_not_serving(self._health, self._health_service)
        if drain.linger_s > 0:
            await asyncio.sleep(drain.linger_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain.timeout_s
        if drain.work is not None:
            await drain.work(drain.timeout_s)
        self._stopped = True
        await self.server.stop(grace=max(drain.min_grace_s, deadline - loop.time()))


@contextlib.asynccontextmanager
async def serving(name: str, server: grpc.aio.Server, health_service: str, host: str,
                  port: int, credentials: grpc.ServerCredentials | None = None
                  ) -> AsyncIterator[Service]:
    """Add grpc.health.v1 to `server` (its servicers already added), everything
    NOT_SERVING, bind ``host:port`` (TLS only with `credentials`) and start it; the block
    gets the `Service` to `run`. On leaving, a server `run` did not stop is stopped at once."""
    health = await transport.add_health(server, health_service)
    bound = await start_server(server, host, port, credentials)
    service = Service(name, server, health, health_service, bound)
    try:
        yield service
    finally:
        if not service._stopped:
            await server.stop(grace=None)
