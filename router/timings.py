"""A request's time to first token, cut into stages measured where they happen; and the
part of it the router itself spends (`OwnTime`)."""

from __future__ import annotations

import time
from contextvars import ContextVar

import grpc

from pdserve.rpc.errors import Continuation, MethodHandler
from pdserve.types import PrefillReport, StageTimings


class OwnTime:
    """The router's own time on a request's way to its first token, on `time.perf_counter`:
    from the call's arrival in the router's Python (`ArrivalInterceptor`, the first of its
    server's interceptors) until the request is on its way to the decode worker (`forward`:
    the Session message handed to grpc, or the Generate call started), plus from the
    worker's first reply read to the client's first response handed to grpc (`done`). What
    it leaves out is waiting on the worker, grpc's own work before the first interceptor and
    after a message is handed to it (serializing a response). A message handed to grpc is on
    the wire: grpc writes it to the socket on the loop's thread as it takes it (strace shows
    the ``sendmsg`` there); the write's completion comes back later through grpc's poller
    thread and delays nothing the request waits for, so it is not counted.

    It travels with the call's task in `OWN` (grpc.aio runs a call's interceptors and handler
    in one task), so the worker clients stamp it without a parameter through every layer."""

    __slots__ = ("arrived", "forwarded", "forwards", "replied")

    def __init__(self, arrived: float) -> None:
        self.arrived = arrived
        self.forwarded = 0.0
        self.forwards = 0  # more than one: an attempt failed, its wait is not the router's
        self.replied = 0.0

    def forward(self, at: float) -> None:
        self.forwarded = at
        self.forwards += 1

    def reply(self, at: float) -> None:
        if not self.replied:
            self.replied = at

    def parts(self, done: float) -> tuple[float, float] | None:
        """(in, out) seconds, or None when not one forward then one reply was seen."""
        if self.forwards != 1 or not self.replied:
            return None
        return self.forwarded - self.arrived, done - self.replied


OWN: ContextVar[OwnTime | None] = ContextVar("pdserve_router_own_time", default=None)


class ArrivalInterceptor(grpc.aio.ServerInterceptor):
    """Starts the call's `OwnTime` (in `OWN`); give it first to `transport.new_server`."""

    async def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> MethodHandler | None:
        OWN.set(OwnTime(time.perf_counter()))
        return await continuation(handler_call_details)


class StageClock:
    """One request's stages on the router's clock (ms), with the prefill worker's own.

    Every stage is measured where it happens and the stages before the first token add up to
    `first_token_ms` by construction of the boundaries:

    - remote:   route + decode_allocate + queued + prefill_compute + kv_transfer + handoff
    - local:    route + local_prefill
    - fallback: route + remote_attempt + local_prefill

    `handoff_ms` is the part of the remote window (allocation done -> first token here) the
    prefill worker did not spend queued, computing or sending KV: dispatching the Prefill call,
    the decode worker's admission and the first token's trip back. Without the prefill
    worker's report (it failed after the KV landed) the window stays in handoff. The worker's
    stages overlap the window's end by the receiver's done reply, so they are cut to fit it.
    """

    def __init__(self, started: float):
        self.started = started
        self._routed = self._allocated = self._fallback = self._first = 0.0
        self._prefill: PrefillReport | None = None

    def routed(self) -> None:
        """A (new) placement: time spent on earlier attempts counts as routing."""
        self._routed = time.monotonic()
        self._allocated = self._fallback = 0.0
        self._prefill = None

    def allocated(self) -> None:
        self._allocated = time.monotonic()

    def fell_back(self) -> None:
        self._fallback = time.monotonic()
        self._allocated, self._prefill = 0.0, None

    def first_token(self) -> None:
        self._first = time.monotonic()

    def since_routed_s(self) -> float:
        """Seconds from the last placement to now."""
        return time.monotonic() - self._routed

    def prefilled(self, outcome: PrefillReport) -> None:
        self._prefill = outcome

    def finish(self) -> StageTimings:
        def ms(a: float, b: float) -> float:
            return (b - a) * 1000.0

        route, total = ms(self.started, self._routed), ms(self.started, time.monotonic())
        if not self._first:
            return StageTimings(route_ms=route, total_ms=total)
        ttft = ms(self.started, self._first)
        if self._fallback:
            return StageTimings(route_ms=route, first_token_ms=ttft,
                                remote_attempt_ms=ms(self._routed, self._fallback),
                                local_prefill_ms=ms(self._fallback, self._first),
                                total_ms=total)
        if not self._allocated:
            return StageTimings(route_ms=route, first_token_ms=ttft,
                                local_prefill_ms=ms(self._routed, self._first),
                                total_ms=total)
        handoff = ms(self._allocated, self._first)
        worker: dict[str, float] = {}
        if (p := self._prefill) is not None:
            # The worker's stages are cut to fit the window, in order: its transfer clock
            # stops at the receiver's done reply, which the decode worker sends after it
            # already has the KV, so on a busy host the first token can reach us before the
            # prefill worker reads its clock.
            for name, value in (("queued_ms", p.queued_ms), ("prefill_compute_ms", p.compute_ms),
                                ("kv_transfer_ms", p.transfer_ms)):
                worker[name] = min(max(value, 0.0), max(handoff, 0.0))
                handoff -= worker[name]
            worker["kv_bytes"] = float(p.bytes_transferred)
        return StageTimings(route_ms=route, first_token_ms=ttft,
                            decode_allocate_ms=ms(self._routed, self._allocated),
                            handoff_ms=max(handoff, 0.0),
                            total_ms=total, **worker)
