"""The router: per request, look up cached prefixes in its KV index (no worker is asked),
decide local vs remote prefill, pick workers, and stream tokens back. Implements
pdserve.gateway.backend.GenerationBackend in-process."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.control.directory import WorkerDirectory
from pdserve.control.kv_events import KVEventStreams
from pdserve.control.registry import WorkerRegistry
from pdserve.control.workers import WorkerInfo
from pdserve.engine.metrics import WorkerLoadCollector
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import OverloadedError, WorkerTimeoutError
from pdserve.types import (
    CapacityError,
    FinishReason,
    GenerateRequest,
    PdserveError,
    PrefillReport,
    TokenEvent,
)
from router import placement
from router.admission import AdmissionConfig, AdmissionController, Ticket
from router.clients import (
    DecodeClient,
    PrefillClient,
    WorkerChannels,
)
from router.cost import CostModel, prefill_capacity
from router.kv_follow import KVIndexFollower
from router.kv_index import KVIndex
from router.placement import DecodeTable
from router.policy import Decision, Route, RouterPolicy

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    policy: RouterPolicy = field(default_factory=RouterPolicy)
    allocate_timeout_s: float = 5.0
    prefill_timeout_s: float = 30.0
    transfer_timeout_s: float = 30.0
    first_token_timeout_s: float = 120.0  # local prefill of a long prompt on a busy worker
    token_timeout_s: float = 60.0  # between two tokens of a running stream
    max_decode_attempts: int = 2  # placements of a request before its first token
    # A stream whose decode worker dies or hangs moves to another one, resuming after the
    # tokens the client has, at most this many times; then the request fails (503).
    max_migrations: int = 2
    # A worker whose lease lapsed is probed once with this deadline: no answer means it is
    # dead or hung, and its requests move (a draining worker answers and keeps its streams).
    lost_probe_timeout_s: float = 2.0
    # A stream that gets nothing for this long has its worker probed (see above): a worker
    # that keeps its lease but does not answer is treated as lost too.
    stall_probe_s: float = 5.0
    stall_probe_failures: int = 3  # probes in a row a registered worker must miss
    drain_grace_s: float = 300.0  # streams on a worker that left may finish within this
    prefill_report_wait_s: float = 1.0  # at a stream's end, for the prefill worker's timings
    # While Redis is unreachable, route on the last known workers for at most this long.
    directory_max_staleness_s: float = 30.0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    cost: CostModel = field(default_factory=CostModel)  # policy.placement == "cost"


class RemotePrefillFailed(PdserveError):
    code = "remote_prefill_failed"


class WorkerLostError(CapacityError):
    """The worker's lease lapsed and it did not answer a probe: dead, hung or cut off."""

    code = "worker_lost"


# Failures of the decode worker, not of the request: the request moves to another worker.
_WORKER_FAILURES = (CapacityError, WorkerTimeoutError, TimeoutError)


class Router:
    def __init__(self, registry: WorkerRegistry, tokenizer: Tokenizer, *, model_name: str,
                 max_model_len: int, config: RouterConfig | None = None,
                 metrics_registry: CollectorRegistry | None = None, poll_s: float = 0.25,
                 channels: WorkerChannels | None = None, model_id: str | None = None):
        self.config = config or RouterConfig()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.directory = WorkerDirectory(
            registry, poll_s=poll_s, max_staleness_s=self.config.directory_max_staleness_s,
            model_id=model_id, any_format=True)  # None: any model (emulated workers)
        self._channels = channels or WorkerChannels()  # the router closes it
        self._placements: dict[str, str] = {}  # request id -> decode worker id
        self._placed: collections.Counter[str] = collections.Counter()  # worker id -> requests
        # Prompt tokens placed for prefill and not done, per worker (see _charge).
        self._inflight_tokens: collections.Counter[str] = collections.Counter()
        self._charges: dict[str, tuple[str, int]] = {}
        self._tiebreak = itertools.count()  # equal-score decode workers take turns
        self._decode_table = DecodeTable()  # placement's columns, kept between requests
        # request id -> the id it runs under on its decode worker, where they differ
        self._worker_ids: dict[str, str] = {}
        self._watch: asyncio.Task[None] | None = None
        self.metrics_registry = metrics_registry or CollectorRegistry()
        # What each decode worker's prefix cache holds, from its KV events (router.kv_index).
        self.kv_index = KVIndex()
        self.kv_follower = KVIndexFollower(
            KVEventStreams(registry), self.kv_index,
            lambda: [w.worker_id for w in self.workers("decode")],
            metrics_registry=self.metrics_registry)
        self.decisions = Counter("pdserve_router_decisions_total",
                                 "Routing decisions by route and reason", ["route", "reason"],
                                 registry=self.metrics_registry)
        self.fallbacks = Counter("pdserve_router_fallbacks_total",
                                 "Remote prefills that failed and were redone locally",
                                 ["cause"], registry=self.metrics_registry)
        self.retries = Counter("pdserve_router_decode_retries_total",
                               "Requests moved to another decode worker before any token",
                               registry=self.metrics_registry)
        self.migrations = Counter("pdserve_router_migrations_total",
                                  "Streams moved to another decode worker after their first "
                                  "token (its worker died, hung or left), by error code",
                                  ["cause"], registry=self.metrics_registry)
        self.workers_lost = Counter("pdserve_router_workers_lost_total",
                                    "Workers whose lease lapsed and that did not answer a probe",
                                    ["role"], registry=self.metrics_registry)
        # worker id -> resolved when that worker is declared lost (see _check_left)
        self._lost: dict[str, asyncio.Future[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._probing: set[str] = set()  # worker ids with a stall probe in flight
        self.admission = AdmissionController(self.config.admission)
        self.rejections = Counter("pdserve_router_rejections_total",
                                  "Requests refused by admission control (HTTP 429, gRPC "
                                  "RESOURCE_EXHAUSTED)", ["latency_class", "reason"],
                                  registry=self.metrics_registry)
        Gauge("pdserve_router_in_flight", "Requests admitted and not finished",
              registry=self.metrics_registry).set_function(lambda: self.admission.in_flight)
        Gauge("pdserve_router_predicted_wait_seconds",
              "Predicted wait for a first token of a request admitted now",
              registry=self.metrics_registry).set_function(self.admission.predicted_wait_s)
        Gauge("pdserve_router_directory_staleness_seconds",
              "Seconds since the worker directory last read Redis (grows while Redis is "
              "unreachable; routing stops past the directory's max_staleness_s)",
              registry=self.metrics_registry).set_function(self.directory.staleness_s)
        # Every worker's engine numbers, from the load records the directory already holds.
        self.metrics_registry.register(WorkerLoadCollector(
            lambda: [(w.worker_id, w.role, w.load) for w in self.directory.snapshot().values()]))

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.directory.start()
        await self.kv_follower.start()
        self._watch = asyncio.create_task(self._follow_workers())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(self._background, timeout=5)
        await self.kv_follower.close()
        await self.directory.close()
        await self._channels.close()

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _follow_workers(self) -> None:
        async for event in self.directory.events():
            if event.kind == "removed":
                log.info("worker_left", worker_id=event.worker.worker_id, role=event.worker.role)
                self._spawn(self._check_left(event.worker))
            elif event.kind == "added":
                log.info("worker_joined", worker_id=event.worker.worker_id,
                         role=event.worker.role)
                lost = self._lost.get(event.worker.worker_id)
                if lost is not None and lost.done():
                    del self._lost[event.worker.worker_id]  # back (e.g. SIGCONT): usable again

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _check_left(self, w: WorkerInfo) -> None:
        """A worker left the directory: deregistered to drain (it still answers, so its
        streams may finish within the drain grace), or its lease lapsed because it died, hung
        or was cut off (no answer to one probe): then its requests move now instead of
        waiting for a token or prefill deadline."""
        failure = await self._probe(w)
        if failure is None:
            self._channels.drop(w.grpc_address, self.config.drain_grace_s)
        else:
            self._declare_lost(w, failure)
            self._channels.drop(w.grpc_address, grace_s=1.0)

    async def _probe(self, w: WorkerInfo) -> str | None:
        """One health check within `lost_probe_timeout_s`: None if the worker answered, else
        why not. Answered by the worker's event loop, so a long engine step is no failure."""
        client = (self._channels.decode(w) if w.role == "decode"
                  else self._channels.prefill(w))
        timeout_s = self.config.lost_probe_timeout_s
        if await client.alive(timeout_s=timeout_s):
            return None
        return f"no answer to a health check within {timeout_s:g}s"

    def _declare_lost(self, w: WorkerInfo, why: str) -> None:
        lost = self._lost_future(w.worker_id)
        if not lost.done():
            log.warning("worker_lost", worker_id=w.worker_id, role=w.role, probe=why)
            self.workers_lost.labels(w.role).inc()
            lost.set_result(None)

    def _stalled(self, w: WorkerInfo) -> None:
        """A stream on `w` got nothing for `stall_probe_s`: probe the worker (one prober per
        worker). A worker that holds its lease but misses `stall_probe_failures` probes in a
        row (its gRPC path cut, its process wedged) is declared lost, so its silent streams
        migrate long before the token deadline; while it stays registered it is probed again
        and taken back once it answers."""
        if w.worker_id in self._probing:
            return
        self._probing.add(w.worker_id)
        cfg = self.config

        async def probe() -> None:
            failures = 0
            try:
                while w.worker_id in self.directory.snapshot():
                    failure = await self._probe(w)
                    if failure is None:
                        if self._is_lost(w.worker_id):
                            log.info("worker_recovered", worker_id=w.worker_id, role=w.role)
                            del self._lost[w.worker_id]  # answers again: may take requests
                        return
                    failures += 1
                    if failures >= cfg.stall_probe_failures:
                        self._declare_lost(w, failure)
                    await asyncio.sleep(1.0 if failures < cfg.stall_probe_failures
                                        else cfg.stall_probe_s)
            finally:
                self._probing.discard(w.worker_id)
        self._spawn(probe())

    def _is_lost(self, worker_id: str) -> bool:
        lost = self._lost.get(worker_id)
        return lost is not None and lost.done()

    def _lost_future(self, worker_id: str) -> asyncio.Future[None]:
        fut = self._lost.get(worker_id)
        if fut is None:
            fut = self._lost[worker_id] = asyncio.get_running_loop().create_future()
        return fut

    def _abort_on(self, decode: DecodeClient, request_id: str) -> None:
        """Best effort, in the background: free what a request left on a worker it moved
        off (a hung worker that resumes must not go on with it)."""
        async def abort() -> None:
            with contextlib.suppress(PdserveError, TimeoutError):
                await decode.abort(request_id, timeout_s=5.0)
        self._spawn(abort())

    def workers(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.directory.snapshot().values() if w.role == role]

    def ready(self) -> tuple[bool, str]:
        if self.directory.expired:
            return False, (f"worker directory is stale: Redis unreachable for "
                           f"{self.directory.staleness_s():.0f}s")
        if not self.workers("decode"):
            return False, "no decode worker is registered"
        return True, "ok"

    # ------------------------------------------------------------------ placement

    async def place(self, req: GenerateRequest, exclude: frozenset[str] = frozenset()
                    ) -> tuple[WorkerInfo, WorkerInfo | None, Decision]:
        decoders = [w for w in self.workers("decode")
                     if w.worker_id not in exclude and not self._is_lost(w.worker_id)]
        if not decoders:
            raise CapacityError("no decode worker is available", code="no_decode_worker")
        prefills = [w for w in self.workers("prefill") if not self._is_lost(w.worker_id)]
        # A migrated request's output counts too: it is prefilled with it.
        p = placement.place(req.token_ids, req.latency_class, decoders, prefills,
                            self.kv_index, self._placed, self.config.policy,
                            cost=self.config.cost,
                            target_s=self.config.admission.deadline_s(req.latency_class),
                            inflight_tokens=self._inflight_tokens,
                            tiebreak=next(self._tiebreak), table=self._decode_table)
        self._set_placement(req.request_id, p.decode.worker_id)  # before any await
        # Its prompt is pending work where it is prefilled until its first token.
        where = p.prefill if p.decision.route is Route.REMOTE else p.decode
        self._charge(req.request_id, where.worker_id if where else None,
                     p.decision.uncached_tokens)
        return p.decode, p.prefill, p.decision

    def _charge(self, request_id: str, worker_id: str | None, tokens: int) -> None:
        """Prompt tokens this router sent `worker_id` to prefill (None: done), so placement
        sees them before the worker's next heartbeat does."""
        old = self._charges.pop(request_id, None)
        if old is not None:
            self._inflight_tokens[old[0]] -= old[1]
            if self._inflight_tokens[old[0]] <= 0:
                del self._inflight_tokens[old[0]]
        if worker_id is not None and tokens > 0:
            self._charges[request_id] = (worker_id, tokens)
            self._inflight_tokens[worker_id] += tokens

    def _set_placement(self, request_id: str, worker_id: str | None) -> None:
        """Where a request runs now (None: nowhere), with the per-worker count kept in step."""
        old = self._placements.pop(request_id, None)
        if old is not None:
            self._placed[old] -= 1
            if not self._placed[old]:
                del self._placed[old]
        if worker_id is not None:
            self._placements[request_id] = worker_id
            self._placed[worker_id] += 1

    # ------------------------------------------------------------------ generation

    def admit(self, req: GenerateRequest) -> Ticket:
        """Admission control (`router.admission`): a ticket, or OverloadedError (counted)."""
        prefills = self.workers("prefill")
        backlog = sum(w.load.queued_tokens for w in prefills)
        capacity = prefill_capacity((w.load for w in [*prefills, *self.workers("decode")]),
                                    self.config.cost or CostModel())
        try:
            return self.admission.decide(req.latency_class, len(req.prompt_token_ids),
                                         time.monotonic(), backlog, capacity)
        except OverloadedError as exc:
            self.rejections.labels(req.latency_class.value, exc.reason).inc()
            log.info("request_rejected", request_id=req.request_id, reason=exc.reason,
                     latency_class=req.latency_class.value, in_flight=self.admission.in_flight,
                     retry_after_s=exc.retry_after_s)
            raise

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens. Closing the iterator cancels it on every worker.

        Admission happens before anything else (`admit`): a refused request raises
        OverloadedError before its first event. The last event carries `timings_ms` (see
        `_Timings`): stages measured where they happen that add up to the time to first
        token."""
        ticket = self.admit(req)
        try:
            async with contextlib.aclosing(self._generate(req)) as events:
                async for ev in events:
                    if ticket.pending:
                        self.admission.first_token(ticket, time.monotonic())
                    yield ev
        finally:
            self.admission.release(ticket)

    async def _generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """Place the request and stream its tokens; if its decode worker fails, place it again.

        Before the first token a failed placement is retried up to `max_decode_attempts`.
        After it, the request migrates (at most `max_migrations` times): a new placement
        prefills prompt + the tokens the client already has (`resume_output_ids`, locally or
        remotely as usual) and the stream continues after them, with nothing repeated or
        missed; greedy and seeded sampling continue as the interrupted stream would have."""
        clock = _Timings(time.monotonic())
        cfg = self.config
        adm = cfg.admission
        first_token_timeout_s = cfg.first_token_timeout_s
        if adm.enabled:  # an admitted request does not wait far past its class's deadline
            first_token_timeout_s = min(first_token_timeout_s, adm.deadline_s(
                req.latency_class) * adm.first_token_deadline_factor)
        tried: set[str] = set()
        streamed: list[int] = []  # output token ids the client has
        retries = migrations = 0
        while True:
            sub = req if not streamed else dataclasses.replace(
                req, resume_output_ids=tuple(streamed))
            decode, prefill, decision = await self.place(sub, frozenset(tried))
            if not streamed:
                clock.routed()
            tried.add(decode.worker_id)
            self.decisions.labels(decision.route.value, decision.reason).inc()
            log.info("route_decision", request_id=req.request_id, route=decision.route.value,
                     reason=decision.reason, uncached_tokens=decision.uncached_tokens,
                     prompt_tokens=len(req.prompt_token_ids), resumed_tokens=len(streamed),
                     decode=decode.worker_id, prefill=prefill.worker_id if prefill else None,
                     latency_class=req.latency_class.value)
            try:
                async with contextlib.aclosing(self._attempt(
                        sub, decode, prefill, decision, clock,
                        # The class deadline bounds the wait for the request's first token
                        # across every attempt; a migrated stream gets a fresh one.
                        first_token_timeout_s if streamed else
                        clock.started + first_token_timeout_s - time.monotonic(),
                        timed=not streamed)) as events:
                    async for ev in events:
                        if req.request_id in self._charges:  # its prompt is prefilled
                            self._charge(req.request_id, None, 0)
                        if ev.token_id is not None:
                            streamed.append(ev.token_id)
                        yield ev
                return
            except _WORKER_FAILURES as exc:
                if isinstance(exc, OverloadedError) or getattr(exc, "code", "") == \
                        "first_token_deadline":
                    raise  # refused, or its deadline is spent: another placement cannot help
                code = getattr(exc, "code", "timeout")
                if not streamed:
                    retries += 1
                    if retries >= cfg.max_decode_attempts:
                        if isinstance(exc, PdserveError):
                            raise
                        # A worker call past its deadline: the worker is busy or gone, not
                        # the request wrong; the client may retry (503), it is not a 504/500.
                        raise WorkerTimeoutError(f"decode worker {decode.worker_id} did not "
                                                 f"answer in time: {_describe(exc)}") from exc
                    self.retries.inc()
                    continue
                self._abort_on(self._channels.decode(decode),
                               self._worker_ids.get(req.request_id, req.request_id))
                if migrations >= cfg.max_migrations:
                    log.warning("migration_exhausted", request_id=req.request_id,
                                migrations=migrations, error=_describe(exc))
                    raise CapacityError(
                        f"decode worker {decode.worker_id} failed mid-stream after "
                        f"{len(streamed)} tokens and the request already moved {migrations} "
                        f"times: {_describe(exc)}", code="migration_exhausted") from exc
                migrations += 1
                self.migrations.labels(code).inc()
                log.warning("stream_migrating", request_id=req.request_id,
                            from_worker=decode.worker_id, resumed_tokens=len(streamed),
                            migration=migrations, error=_describe(exc))
            finally:
                self._set_placement(req.request_id, None)
                self._charge(req.request_id, None, 0)
                self._worker_ids.pop(req.request_id, None)

    async def _attempt(self, req: GenerateRequest, decode: WorkerInfo, prefill: WorkerInfo | None,
                       decision: Decision, clock: _Timings, first_token_timeout_s: float, *,
                       timed: bool) -> AsyncGenerator[TokenEvent, None]:
        """One placement's events, tagged; raises WorkerLostError the moment the decode worker
        is declared lost. `timed`: this placement's stages are the request's TTFT stages.
        `first_token_timeout_s` bounds the wait for its first token, remote attempt and local
        fallback together (each stage's own limit applies too)."""
        first_token_by = time.monotonic() + first_token_timeout_s
        client_id = req.request_id

        def budget() -> float:
            left = first_token_by - time.monotonic()
            if left <= 0:
                raise WorkerTimeoutError(
                    f"no first token within {first_token_timeout_s:.0f}s, the request's "
                    "deadline", code="first_token_deadline")
            return left

        dclient = self._channels.decode(decode)
        route = decision.route
        lost = self._lost_future(decode.worker_id)
        if route is Route.REMOTE and prefill is not None:
            try:
                async with contextlib.aclosing(_until(lost, self._remote(
                        req, dclient, self._channels.prefill(prefill), clock, timed=timed,
                        budget_s=budget()),
                        lambda: WorkerLostError(f"decode worker {decode.worker_id} is lost"),
                        stall_s=self.config.stall_probe_s,
                        on_stall=lambda: self._stalled(decode))) as events:
                    async for ev in events:
                        yield self._tag(ev, route, clock, decode, prefill)
                return
            except RemotePrefillFailed as exc:
                self.fallbacks.labels(exc.code).inc()
                log.warning("remote_prefill_fallback", request_id=req.request_id,
                            error=exc.message)
                route = Route.FALLBACK
                if timed:
                    clock.fell_back()
                # The remote attempt's allocation may still be being fenced on the decode worker
                # (its abort is bounded in time, not guaranteed): the local prefill runs under
                # an id of its own there, so the two never collide ("duplicate request id").
                req = dataclasses.replace(req, request_id=f"{client_id[:240]}#fallback")
                self._worker_ids[client_id] = req.request_id
        first = True
        async with contextlib.aclosing(_until(lost, dclient.generate(
                req, first_token_timeout_s=budget(),
                token_timeout_s=self.config.token_timeout_s),
                lambda: WorkerLostError(f"decode worker {decode.worker_id} is lost"),
                stall_s=self.config.stall_probe_s,
                on_stall=lambda: self._stalled(decode))) as events:
            async for ev in events:
                if first and timed:
                    clock.first_token()
                first = False
                yield self._tag(ev, route, clock, decode,
                                prefill if route is Route.FALLBACK else None,
                                request_id=client_id)

    @staticmethod
    def _tag(ev: TokenEvent, route: Route, clock: _Timings, decode: WorkerInfo,
             prefill: WorkerInfo | None, request_id: str | None = None) -> TokenEvent:
        """Tag events with where they ran (and the client's request id); the last one also
        gets the stage timings."""
        extra: dict[str, object] = {
            "route": route.value, "decode_worker": decode.worker_id,
            "prefill_worker": prefill.worker_id if prefill else None}
        if request_id is not None:
            extra["request_id"] = request_id
        if ev.finished:
            extra["timings_ms"] = clock.finish()
        return dataclasses.replace(ev, **extra)  # type: ignore[arg-type]

    async def _remote(self, req: GenerateRequest, decode: DecodeClient, prefill: PrefillClient,
                      clock: _Timings, *, timed: bool = True, budget_s: float | None = None,
                      ) -> AsyncGenerator[TokenEvent, None]:
        """Allocate on the decode worker, prefill on the prefill worker, stream from the KV's
        arrival on. RemotePrefillFailed before the first token means: prefill locally.
        `budget_s` caps the prefill and KV waits (the request's first-token deadline)."""
        cfg = self.config
        prefill_timeout_s = min(cfg.prefill_timeout_s, budget_s or cfg.prefill_timeout_s)
        kv_wait_s = min(cfg.prefill_timeout_s + cfg.transfer_timeout_s,
                        budget_s or cfg.prefill_timeout_s + cfg.transfer_timeout_s)
        decode_lost = self._lost_future(decode.worker_id)
        prefill_lost = self._lost_future(prefill.worker_id)
        try:
            slot = await decode.allocate(req, lease_s=prefill_timeout_s,
                                         timeout_s=cfg.allocate_timeout_s)
        except CapacityError as exc:
            raise RemotePrefillFailed(f"decode allocation failed: {exc}",
                                      code="allocate_failed") from exc
        if timed:
            clock.allocated()
        # Open the decode stream first: it starts decoding the moment the KV lands, taking the
        # first token from the transfer's completion notice (no extra hop through us).
        stream = decode.generate_remote(
            slot, transfer_timeout_s=kv_wait_s,
            token_timeout_s=cfg.token_timeout_s)
        first_task: asyncio.Task[TokenEvent] = asyncio.create_task(anext(stream))  # type: ignore[arg-type]
        prefill_task = asyncio.create_task(
            prefill.prefill(req, slot, timeout_s=prefill_timeout_s))
        try:
            racing: set[asyncio.Future[Any]] = {prefill_task, first_task, prefill_lost}
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            if not first_task.done() and prefill_lost.done():
                raise RemotePrefillFailed(f"prefill worker {prefill.worker_id} is lost",
                                          code="prefill_worker_lost")
            if not first_task.done() and prefill_task.exception() is not None:
                raise RemotePrefillFailed(f"prefill worker {prefill.worker_id} failed: "
                                          f"{_describe(prefill_task.exception())}",
                                          code="prefill_failed")
            try:
                first = await first_task
            except (PdserveError, TimeoutError) as exc:
                if decode_lost.done():
                    raise  # the decode worker itself is gone: another one takes the request
                raise RemotePrefillFailed(f"KV never arrived: {_describe(exc)}",
                                          code="transfer_failed") from exc
            if timed:
                clock.first_token()
            yield first
            if first.finished:
                if timed:
                    await self._prefill_report(prefill_task, clock)
                return
            async for ev in stream:
                if ev.finished and timed:
                    await self._prefill_report(prefill_task, clock)
                yield ev
        except BaseException:
            first_task.cancel()
            prefill_task.cancel()
            # Make sure the decode worker fences the transfer and frees the blocks before a
            # fallback reuses the request id there; a lost one is not waited for.
            if decode_lost.done():
                self._abort_on(decode, req.request_id)
            else:
                with contextlib.suppress(PdserveError, TimeoutError, asyncio.CancelledError):
                    await asyncio.shield(decode.abort(req.request_id))
            raise
        finally:
            if not first_task.done():
                first_task.cancel()
                with contextlib.suppress(BaseException):
                    await first_task  # the stream must not be running when we close it
            await stream.aclose()  # type: ignore[attr-defined]

    async def _prefill_report(self, task: asyncio.Task[PrefillReport], clock: _Timings) -> None:
        """Put the prefill worker's stage timings into `clock`. Its reply may trail the first
        tokens (it frees its blocks before answering): wait a little for it, never fail."""
        if not task.done():
            await asyncio.wait({task}, timeout=self.config.prefill_report_wait_s)
        if task.done() and not task.cancelled() and task.exception() is None:
            clock.prefilled(task.result())

    async def abort(self, request_id: str) -> bool:
        worker_id = self._placements.get(request_id)
        w = self.directory.get(worker_id) if worker_id else None
        if w is None:
            return False
        return await self._channels.decode(w).abort(self._worker_ids.get(request_id, request_id))


class _Timings:
    """One request's stages on the router's clock (ms), with the prefill worker's own.

    Every stage is measured where it happens and the stages before the first token add up to
    `ttft_ms` by construction of the boundaries:

    - remote:   route + decode_allocate + prefill_queued + prefill_compute + kv_transfer + handoff
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

    def prefilled(self, outcome: PrefillReport) -> None:
        self._prefill = outcome

    def finish(self) -> dict[str, float]:
        def ms(a: float, b: float) -> float:
            return (b - a) * 1000.0

        out: dict[str, float] = {"route_ms": ms(self.started, self._routed)}
        if self._first:
            out["ttft_ms"] = ms(self.started, self._first)
            if self._fallback:
                out["remote_attempt_ms"] = ms(self._routed, self._fallback)
                out["local_prefill_ms"] = ms(self._fallback, self._first)
            elif self._allocated:
                out["decode_allocate_ms"] = ms(self._routed, self._allocated)
                handoff = ms(self._allocated, self._first)
                if (p := self._prefill) is not None:
                    # The worker's stages are cut to fit the window, in order: its transfer
                    # clock stops at the receiver's done reply, which the decode worker sends
                    # after it already has the KV, so on a busy host the first token can reach
                    # us before the prefill worker reads its clock.
                    stages = {}
                    for key, value in (("prefill_queued_ms", p.queued_ms),
                                       ("prefill_compute_ms", p.compute_ms),
                                       ("kv_transfer_ms", p.transfer_ms)):
                        stages[key] = min(max(value, 0.0), max(handoff, 0.0))
                        handoff -= stages[key]
                    out.update(stages, kv_bytes=float(p.bytes_transferred))
                out["handoff_ms"] = max(handoff, 0.0)
            else:
                out["local_prefill_ms"] = ms(self._routed, self._first)
        out["total_ms"] = ms(self.started, time.monotonic())
        return out


async def _until(lost: asyncio.Future[None], events: AsyncIterator[TokenEvent],
                 error: Callable[[], BaseException], *, stall_s: float,
                 on_stall: Callable[[], None] | None = None,
                 ) -> AsyncGenerator[TokenEvent, None]:
    """`events`, until the worker is lost *and* its stream silent: once `lost` resolves, a
    read that has waited `stall_s` since the last event is cancelled (the stream closes) and
    `error()` is raised; a stream still delivering goes on (a live worker whose lease lapsed
    because it was starved of CPU). `on_stall()` is called each time a read waits `stall_s`."""
    last = time.monotonic()
    try:
        while True:
            read = asyncio.ensure_future(anext(events))
            try:
                while not read.done():
                    if lost.done():
                        left = last + stall_s - time.monotonic()
                        if left <= 0:
                            break
                        await asyncio.wait({read}, timeout=left)
                        continue
                    either: set[asyncio.Future[Any]] = {read, lost}
                    await asyncio.wait(either, timeout=stall_s,
                                       return_when=asyncio.FIRST_COMPLETED)
                    if (on_stall is not None and not read.done() and not lost.done()
                            and time.monotonic() - last >= stall_s):
                        on_stall()
            finally:
                if not read.done():
                    read.cancel()
                    with contextlib.suppress(BaseException):
                        await read
            if read.cancelled():
                raise error()
            try:
                ev = read.result()
            except StopAsyncIteration:
                return
            last = time.monotonic()
            yield ev
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, PdserveError):
        return f"{exc.code}: {exc.message}"
    return repr(exc)


__all__ = ["FinishReason", "Router", "RouterConfig"]
