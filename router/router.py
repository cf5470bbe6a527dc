"""The router: per request, look up cached prefixes in its KV index (no worker is asked),
decide local vs remote prefill, pick workers, and stream tokens back. Implements
pdserve.gateway.backend.GenerationBackend in-process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Mapping, Sequence
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from pdserve.aio import AsyncResource, stop_task
from pdserve.control.directory import WorkerDirectory
from pdserve.control.inflight import InflightBoard, InflightCounts, new_router_id, newest
from pdserve.control.kv_events import KVEventStreams
from pdserve.control.registry import WorkerRegistry
from pdserve.control.workers import WorkerInfo
from pdserve.engine.metrics import WorkerLoadCollector
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import (
    CapacityError,
    ErrorCode,
    OverloadedError,
    PdserveError,
    RemotePrefillFailed,
    WorkerLostError,
    WorkerTimeoutError,
    code_of,
)
from pdserve.ratelog import RateLimitedLog
from pdserve.types import FinishReason, GenerateRequest, StageTimings, TokenEvent
from router import placement
from router.admission import AdmissionController, Ticket, external_backlog
from router.calibration import RemoteOverhead
from router.clients import (
    DecodeClient,
    WorkerChannels,
)
from router.config import RouterConfig
from router.cost import CostModel, peer_prefill_rate, prefill_capacity
from router.kv_follow import KVIndexFollower
from router.kv_index import KVIndex
from router.ledger import PlacementLedger
from router.liveness import Liveness
from router.metrics import RouterMetrics
from router.placement import DecodeTable
from router.policy import Decision, Route
from router.remote import describe, prefill_wait_s, remote_prefill
from router.timings import StageClock

log = structlog.get_logger(__name__)


# Failures of the decode worker, not of the request: the request moves to another worker.
_WORKER_FAILURES = (CapacityError, WorkerTimeoutError, TimeoutError)
# Beyond the directory's poll period: the most a load read from Redis can lag the worker's
# count of what this router sent it (the heartbeat's write, the request's way there).
LOAD_MARGIN_S = 0.1
# Pushes of this router's in-flight counts to its peers come at most this often (a burst's
# placements go out together), and no more often than every PUSH_COST_FACTOR x the time the
# last one took, making the record and the Redis round trip (which is what costs: with 64
# workers, 0.05 ms to make a record and 0.2-0.3 ms of redis-py's CPU to send it, on a Zen 4
# guest), nor less often than every PUSH_GAP_MAX_S (or `share_inflight_s`, if shorter)
# while they move. A router that bounded its pushes by the record's making alone spent
# 35-40 % more CPU per request with a peer than alone in the router harness
# (docs/bench/placement_s82).
PUSH_GAP_S = 0.005
PUSH_COST_FACTOR = 100
PUSH_GAP_MAX_S = 0.05
# A router alone on its Redis renews its in-flight record this many times per lease, and does
# nothing else: an exchange every `share_inflight_s` with no one to share with cost the router
# harness's light phase up to half its decisions per CPU-second (docs/bench/placement_s81).
LONE_RENEWALS_PER_TTL = 3


@dataclasses.dataclass(frozen=True)
class Resumed:
    """A request the compiled data plane (router.dataplane) admitted under `ticket` and
    placed, handed to `Router.generate` to go on with. Either it streamed from decode worker
    `worker_id` until that worker failed it with `error`, the client holding `streamed`:
    `generate` goes on as after a failed attempt of its own; or (`placed`) it is placed, and
    entered in the ledger, on a route the data plane does not stream itself (a remote
    prefill): `generate` runs that placement as its first attempt, not placing it again."""

    ticket: Ticket
    worker_id: str = ""
    error: BaseException | None = None
    streamed: tuple[int, ...] = ()
    placed: placement.Placement | None = None


class Router(AsyncResource):
    def __init__(self, registry: WorkerRegistry, tokenizer: Tokenizer, *, model_name: str,
                 max_model_len: int, config: RouterConfig | None = None,
                 metrics_registry: CollectorRegistry | None = None, poll_s: float | None = None,
                 channels: WorkerChannels | None = None, model_id: str | None = None):
        self.config = config or RouterConfig()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.directory = WorkerDirectory(
            registry, poll_s=self.config.directory_poll_s if poll_s is None else poll_s,
            max_staleness_s=self.config.directory_max_staleness_s,
            model_id=model_id, any_format=True)  # None: any model (emulated workers)
        self._channels = channels or WorkerChannels()  # the router closes it
        self.ledger = PlacementLedger()  # what this router placed where (in-flight accounting)
        # ... shared with the other routers on this Redis (router replicas)
        self.router_id = new_router_id()
        share_s = self.config.share_inflight_s
        self.inflight_board = InflightBoard(registry, self.router_id,
                                            ttl_s=max(2.0, 10 * share_s)) if share_s else None
        self._share: asyncio.Task[None] | None = None
        self._follow: asyncio.Task[None] | None = None
        self._inflight_changed = asyncio.Event()  # this router's counts moved: push them
        self.ledger.on_change = self._counts_moved
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._share_failed = RateLimitedLog(log, "inflight_share_failed", level="error")
        self._tiebreak = itertools.count()  # equal-score decode workers take turns
        self._decode_table = DecodeTable()  # placement's columns, kept between requests
        # The live (not lost) decode and prefill workers, rebuilt only when the directory or
        # the lost set moved: (directory generation, expired, liveness generation) -> lists.
        self._live_key: tuple[int, bool, int] | None = None
        self._live: tuple[list[WorkerInfo], list[WorkerInfo]] = ([], [])
        # Admission's view of the cluster (prefill backlog, prefill capacity), from the
        # loads the directory holds: recomputed when it polled, not per request.
        self._capacity_key: tuple[int, bool] | None = None
        self._capacity: tuple[tuple[tuple[str, float], ...], float] = ((), 0.0)
        self._peer_rate: float | None = None  # router.cost.peer_prefill_rate, as of then
        # request id -> the id it runs under on its decode worker, where they differ
        self._worker_ids: dict[str, str] = {}
        self._watch: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.metrics_registry = metrics_registry or CollectorRegistry()
        self.metrics = RouterMetrics(self.metrics_registry)
        self.liveness = Liveness(self.config.liveness, self.directory, self._channels,
                                 self.metrics.workers_lost, self._spawn)
        # What each worker's prefix cache holds (decode and prefill workers: the ids are one
        # namespace), from its KV events (router.kv_index).
        self.kv_index = KVIndex()
        self.kv_follower = KVIndexFollower(
            KVEventStreams(registry), self.kv_index,
            lambda: [w.worker_id for w in self.directory.snapshot().values()
                     if w.role in ("decode", "prefill")],
            metrics_registry=self.metrics_registry)
        self.admission = AdmissionController(self.config.admission)
        self.remote_overhead = (RemoteOverhead.of_window(self.config.remote_overhead_window)
                                if self.config.policy.placement == "cost" else None)
        self._cost = self.config.cost  # with the learned remote overhead in it
        self.metrics.gauges(in_flight=lambda: self.admission.in_flight,
                            predicted_wait_s=self.admission.predicted_wait_s,
                            directory_staleness_s=self.directory.staleness_s,
                            peer_routers=lambda: len(self.ledger.peers))
        # Every worker's engine numbers, from the load records the directory already holds.
        self.metrics_registry.register(WorkerLoadCollector(
            lambda: [(w.worker_id, w.role, w.load) for w in self.directory.snapshot().values()]))
        self.directory.on_refresh(self.prepare)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.directory.start()
        await self.kv_follower.start()
        self._watch = asyncio.create_task(self._follow_workers())
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        if self.inflight_board is not None:
            self._share = asyncio.create_task(self._share_inflight(self.inflight_board),
                                              name="share-inflight")
            self._follow = asyncio.create_task(self.inflight_board.follow(self._pushed),
                                               name="follow-inflight")

    async def close(self) -> None:
        for task in (self._watch, self._share, self._follow):
            await stop_task(task)
        if self.inflight_board is not None:
            with contextlib.suppress(PdserveError):  # else it lapses within its ttl
                await self.inflight_board.leave()
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(self._background, timeout=5)
        await self.kv_follower.close()
        await self.directory.close()
        await self._channels.close()


    async def _follow_workers(self) -> None:
        async for event in self.directory.events():
            if event.kind == "removed":
                log.info("worker_left", worker_id=event.worker.worker_id, role=event.worker.role)
                self._spawn(self.liveness.check_left(event.worker))
            elif event.kind == "added":
                log.info("worker_joined", worker_id=event.worker.worker_id,
                         role=event.worker.role)
                self.liveness.joined(event.worker.worker_id)

    async def _share_inflight(self, board: InflightBoard) -> None:
        """Every `share_inflight_s` while other routers share this Redis: this router's
        in-flight counts out, theirs in (router.ledger, pdserve.control.inflight), and its
        counts pushed out as soon as they move (PUSH_GAP_S, PUSH_COST_FACTOR). Alone, it
        only renews its record, every third of the lease (LONE_RENEWALS_PER_TTL): a new
        router's first exchange is published on the channel this router follows, so it
        learns of it at once all the same. While Redis does not answer, the others' counts
        are kept for the board's ttl (theirs lapse in Redis as fast), then dropped: this
        router places on its own counts and the heartbeats, as one router alone does."""
        period = self.config.share_inflight_s
        ttl_s = board.ttl_ms / 1000
        lone_s = max(period, ttl_s / LONE_RENEWALS_PER_TTL)
        last_ok = time.monotonic()
        last_full = -math.inf

        def full_due() -> float:  # the next exchange: soon with peers, rarely alone
            return last_full + (period if self.ledger.peers else lone_s)
        while True:
            due = full_due()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, due - time.monotonic())):
                    await self._inflight_changed.wait()
            self._inflight_changed.clear()
            # a peer that came (or went) during the wait moves the due time
            full = time.monotonic() >= full_due()
            if full:
                last_full = time.monotonic()
            start = time.perf_counter()
            try:
                if not full:
                    await board.push(*self.ledger.shared())
                else:
                    others = await board.exchange(*self.ledger.shared())
                    last_ok = time.monotonic()
                    self._set_peers(newest(others, self.ledger.peers))
            except Exception as err:
                if not isinstance(err, PdserveError):  # a bug: logged, placing goes on
                    self._share_failed("bug", error=repr(err))
                if self.ledger.peers and time.monotonic() - last_ok > ttl_s:
                    log.warning("inflight_share_lost", error=str(err),
                                peers=len(self.ledger.peers))
                    self._set_peers({})
            spent = time.perf_counter() - start  # wall time: at least the loop's CPU for it
            await asyncio.sleep(min(period, PUSH_GAP_MAX_S,
                                    max(PUSH_GAP_S, PUSH_COST_FACTOR * spent)))

    def _counts_moved(self) -> None:
        """The ledger's own counts moved (and it has peers): push them. The compiled data
        plane places on grpc's thread while the loop is parked; from there the loop is
        woken to push."""
        if threading.get_ident() == self._loop_thread or self._loop is None:
            self._inflight_changed.set()
        else:
            self._loop.call_soon_threadsafe(self._inflight_changed.set)

    def _pushed(self, counts: InflightCounts) -> None:
        """Another router's counts as it pushed them, if newer than those held (or new):
        only its own are taken in again."""
        held = self.ledger.peers.get(counts.router_id)
        if held is None:
            self._set_peers({**self.ledger.peers, counts.router_id: counts})
        elif counts.seq > held.seq:
            self.ledger.take(counts)

    def _set_peers(self, peers: Mapping[str, InflightCounts]) -> None:
        """The other routers' counts as now known, into the ledger (logged when the set of
        routers changes; a first peer: exchange on the short period from now on)."""
        if peers.keys() != self.ledger.peers.keys():
            log.info("router_peers", peers=sorted(peers), router_id=self.router_id)
            if peers and not self.ledger.peers:
                self._inflight_changed.set()
        self.ledger.merge(peers.values())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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

    def _live_workers(self) -> tuple[list[WorkerInfo], list[WorkerInfo]]:
        """The directory's decode and prefill workers not declared lost; filtered again
        only when either changed, not per request (O(workers) in Python)."""
        key = (self.directory.generation, self.directory.expired, self.liveness.generation)
        if key != self._live_key:
            live = [w for w in self.directory.snapshot().values()
                    if not self.liveness.is_lost(w.worker_id)]
            self._live = ([w for w in live if w.role == "decode"],
                          [w for w in live if w.role == "prefill"])
            self._live_key = key
        return self._live

    def prepare(self) -> None:
        """What placement and admission derive from the directory, rebuilt as soon as it
        polled (every `directory_poll_s`, a heartbeat's load or two having changed): the
        live lists, the columns of the placement table (and cost placement's table in C)
        and the admission view. Otherwise the first request after each poll would pay for
        it, O(workers) in Python, on its way to a first token."""
        decoders, prefills = self._live_workers()
        # The loads just read: a worker's `finished` count starts again with a new one.
        self.ledger.saw_loads(((w.worker_id, w.load) for w in decoders),
                              self.config.directory_poll_s + LOAD_MARGIN_S)
        if decoders:
            table = self._decode_table
            dcols = table.columns(decoders, self.kv_index, self._live_key)
            if self.config.policy.placement == "cost":
                table.fast_cost(dcols, table.prefill_columns(prefills, self.kv_index,
                                                             self._live_key), self._cost)
        self._admission_view()

    async def place(self, req: GenerateRequest, exclude: frozenset[str] = frozenset()
                    ) -> tuple[WorkerInfo, WorkerInfo | None, Decision]:
        return self.place_now(req, exclude)

    def place_now(self, req: GenerateRequest, exclude: frozenset[str] = frozenset()
                  ) -> tuple[WorkerInfo, WorkerInfo | None, Decision]:
        """Place `req` (not on `exclude`) and enter it in the ledger; CapacityError when no
        decode worker is left."""
        p, cpu_s = self.choose(req, exclude)
        self.enter(req, p, cpu_s)
        return p.decode, p.prefill, p.decision

    def choose(self, req: GenerateRequest, exclude: frozenset[str] = frozenset(), *,
               hash_ids: Sequence[int] | None = None) -> tuple[placement.Placement, float]:
        """`place_now`'s placement, not yet entered: the placement and the CPU seconds it
        took; `enter` it before anything else is placed (the compiled data plane sends the
        request on its way in between). `hash_ids`: `req.token_ids` as the caller has them
        in a form faster to hash (native int32s: the compiled data plane's)."""
        cpu = time.thread_time()  # its own thread's: not the gRPC threads sharing its core
        ids: Sequence[int] = req.token_ids
        if hash_ids is not None and len(hash_ids) == len(ids):
            ids = hash_ids
        decoders, prefills = self._live_workers()
        listing = self._live_key  # names these very lists (`_live_workers`)
        if exclude:
            decoders = [w for w in decoders if w.worker_id not in exclude]
            listing = None
        if not decoders:
            raise CapacityError("no decode worker is available", code=ErrorCode.NO_DECODE_WORKER)
        # A migrated request's output counts too: it is prefilled with it.
        p = placement.place(ids, req.latency_class, decoders, prefills,
                            self.kv_index, self.ledger.placed, self.config.policy,
                            cost=self._cost,
                            target_s=self.config.ttft_target_s(req.latency_class),
                            inflight_tokens=self.ledger.inflight_tokens,
                            tiebreak=next(self._tiebreak), table=self._decode_table,
                            listing=listing, finished=self.ledger.finished)
        return p, time.thread_time() - cpu

    def enter(self, req: GenerateRequest, p: placement.Placement, cpu_s: float) -> None:
        """`choose`'s placement of `req` in the ledger (and its CPU in the metrics)."""
        self.ledger.place(req.request_id, p.decode.worker_id)  # before any await
        # Its prompt is pending work where it is prefilled until its first token.
        where = p.prefill if p.decision.route is Route.REMOTE else p.decode
        self.ledger.charge(req.request_id, where.worker_id if where else None,
                           p.decision.uncached_tokens)
        self.metrics.placement_cpu.inc(cpu_s)

    # ------------------------------------------------------------------ generation

    def _prefill_wait_s(self, prefill: WorkerInfo) -> float:
        """`router.remote.prefill_wait_s` with what this router sent the prefill worker, at
        its rate as cost placement assumes it."""
        self._admission_view()  # the peers' rate, as of the directory's last poll
        rate = self.config.cost.prefill_rate(prefill.load, self._peer_rate)
        return prefill_wait_s(prefill.load,
                              self.ledger.inflight_tokens.get(prefill.worker_id, 0.0), rate)

    def first_token(self, decision: Decision, observed_s: float) -> None:
        """A first token on the route its placement chose: against cost placement's
        prediction (`pdserve_router_ttft_prediction_ratio`)."""
        predicted = decision.predicted_ttft_s
        if predicted is not None and predicted > 0:
            self.metrics.ttft_ratios[decision.route.value].observe(observed_s / predicted)

    def _remote_stages(self, timings: StageTimings, decode: WorkerInfo) -> None:
        """A remote request's measured allocation + hand-off teach cost placement its fixed
        remote cost (router.calibration), when the decode step it was priced with was the
        worker's own measurement and the prefill worker's report split its stages."""
        learner, step = self.remote_overhead, decode.load.decode_step_s
        allocate, handoff = timings.decode_allocate_ms, timings.handoff_ms
        if (learner is None or not step or allocate is None or handoff is None
                or timings.prefill_compute_ms is None):
            return
        learner.observe((allocate + handoff) / 1e3, step, self.config.cost)
        self._cost = learner.apply(self.config.cost)
        self.metrics.remote_overhead.set(learner.offset_s)

    def admit(self, req: GenerateRequest) -> Ticket:
        """Admission control (`router.admission`): a ticket, or OverloadedError (counted)."""
        queued, capacity = self._admission_view()
        backlog = external_backlog(queued, self.ledger.inflight_tokens)
        try:
            return self.admission.decide(req.latency_class, len(req.prompt_token_ids),
                                         time.monotonic(), backlog, capacity)
        except OverloadedError as exc:
            self.metrics.rejections.labels(req.latency_class.value, exc.reason).inc()
            log.info("request_rejected", request_id=req.request_id, reason=exc.reason,
                     latency_class=req.latency_class.value, in_flight=self.admission.in_flight,
                     retry_after_s=exc.retry_after_s)
            raise

    def _admission_view(self) -> tuple[tuple[tuple[str, float], ...], float]:
        """(each prefill worker's id and queued prompt tokens, the cluster's prefill tokens/s)
        from the workers' last loads. They move only when the directory polls, so this is
        computed once per poll, not per request (O(workers) in Python)."""
        key = (self.directory.generation, self.directory.expired)
        if key != self._capacity_key:
            workers = [w for w in self.directory.snapshot().values()
                       if w.role in ("prefill", "decode")]
            queued = tuple((w.worker_id, w.load.queued_tokens) for w in workers
                           if w.role == "prefill" and w.load.queued_tokens)
            self._capacity = (queued, prefill_capacity(
                (w.load for w in workers), self.config.cost or CostModel()))
            self._peer_rate = peer_prefill_rate(w.load for w in workers)
            self._capacity_key = key
        return self._capacity

    async def generate(self, req: GenerateRequest, resumed: Resumed | None = None
                       ) -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens. Closing the iterator cancels it on every worker.

        Admission happens before anything else (`admit`): a refused request raises
        OverloadedError before its first event. The last event carries `timings`
        (`router.timings.StageClock`): stages measured where they happen that add up to the
        time to first token. `resumed`: a request the compiled data plane admitted and placed
        (`Resumed`): its stream goes on after what the client has, or starts on the route
        placed there."""
        ticket = self.admit(req) if resumed is None else resumed.ticket
        try:
            async with contextlib.aclosing(self._generate(req, resumed)) as events:
                async for ev in events:
                    if ticket.pending:
                        self.admission.first_token(ticket, time.monotonic())
                    yield ev
        finally:
            self.admission.release(ticket)

    async def _generate(self, req: GenerateRequest, resumed: Resumed | None = None
                        ) -> AsyncGenerator[TokenEvent, None]:
        """Place the request and stream its tokens; if its decode worker fails, place it again.

        Before the first token a failed placement is retried up to `max_decode_attempts`.
        After it, the request migrates (at most `max_migrations` times): a new placement
        prefills prompt + the tokens the client already has (`resume_output_ids`, locally or
        remotely as usual) and the stream continues after them, with nothing repeated or
        missed; greedy and seeded sampling continue as the interrupted stream would have."""
        clock = StageClock(time.monotonic())
        cfg = self.config
        adm = cfg.admission
        first_token_timeout_s = cfg.first_token_timeout_s
        if adm.enabled:  # an admitted request does not wait far past its class's deadline
            first_token_timeout_s = min(first_token_timeout_s, adm.deadline_s(
                req.latency_class) * adm.first_token_deadline_factor)
        first_token_by = clock.started + first_token_timeout_s  # across every attempt
        tried: set[str] = set()
        streamed: list[int] = []  # output token ids the client has
        retries = migrations = 0
        failed: tuple[str, BaseException] | None = None  # the last attempt's worker and error
        placed = resumed.placed if resumed is not None else None  # the data plane's, entered
        if resumed is not None and placed is None:  # its attempt failed: as if it were ours
            assert resumed.error is not None
            if not isinstance(resumed.error, _WORKER_FAILURES):
                raise resumed.error
            streamed = list(resumed.streamed)
            tried.add(resumed.worker_id)
            failed = (resumed.worker_id, resumed.error)
            retries, migrations = self._after_failure(
                req, resumed.error, self.directory.get(resumed.worker_id), resumed.worker_id,
                streamed, retries, migrations, first_token_by, first_token_timeout_s)
        while True:
            sub = req if not streamed else dataclasses.replace(
                req, resume_output_ids=tuple(streamed))
            try:
                if placed is not None:
                    decode, prefill, decision = placed.decode, placed.prefill, placed.decision
                    placed = None
                else:
                    decode, prefill, decision = await self.place(sub, frozenset(tried))
            except CapacityError as exc:
                if failed is None or exc.code != ErrorCode.NO_DECODE_WORKER:
                    raise
                worker_id, cause = failed  # the client hears why, not only that none is left
                raise CapacityError(f"decode worker {worker_id} failed and no other decode "
                                    f"worker is available: {describe(cause)}",
                                    code=ErrorCode.NO_DECODE_WORKER) from cause
            if not streamed:
                clock.routed()
            tried.add(decode.worker_id)
            self.metrics.decided(decision.route.value, decision.reason)
            # Logged once the first event is on its way (or the attempt ended without one):
            # rendering the line is not on the way to the client's first token.
            unlogged = [dict(
                request_id=req.request_id, route=decision.route.value,
                reason=decision.reason, uncached_tokens=decision.uncached_tokens,
                prompt_tokens=len(req.prompt_token_ids), resumed_tokens=len(streamed),
                decode=decode.worker_id, prefill=prefill.worker_id if prefill else None,
                latency_class=req.latency_class.value,
                predicted_ttft_s=decision.predicted_ttft_s)]
            try:
                async with contextlib.aclosing(self._attempt(
                        sub, decode, prefill, decision, clock,
                        # The class deadline bounds the wait for the request's first token
                        # across every attempt; a migrated stream gets a fresh one.
                        first_token_timeout_s if streamed else first_token_by - time.monotonic(),
                        timed=not streamed)) as events:
                    first = not streamed
                    async for ev in events:
                        observed = None  # the first token's time after placement, as placed
                        if first:
                            first = False
                            if ev.token_id is not None and ev.route == decision.route.value:
                                observed = clock.since_routed_s()
                        if self.ledger.charged(req.request_id):  # its prompt is prefilled
                            self.ledger.charge(req.request_id, None, 0)
                        if ev.token_id is not None:
                            streamed.append(ev.token_id)
                        if (ev.timings is not None and ev.route == Route.REMOTE.value
                                and not migrations):  # the last event: its consumer may
                            self._remote_stages(ev.timings, decode)  # stop at it
                        if observed is not None and ev.finished:
                            self.first_token(decision, observed)
                            observed = None
                        yield ev
                        if observed is not None:  # not on the first token's way
                            self.first_token(decision, observed)
                        if unlogged:
                            log.info("route_decision", **unlogged.pop())
                return
            except _WORKER_FAILURES as exc:
                if unlogged:
                    log.info("route_decision", **unlogged.pop())
                failed = (decode.worker_id, exc)
                retries, migrations = self._after_failure(
                    req, exc, decode, decode.worker_id, streamed, retries, migrations,
                    first_token_by, first_token_timeout_s)
            finally:
                if unlogged:
                    log.info("route_decision", **unlogged.pop())
                self.ledger.release(req.request_id)
                self._worker_ids.pop(req.request_id, None)

    def _after_failure(self, req: GenerateRequest, exc: BaseException,
                       decode: WorkerInfo | None, worker_id: str, streamed: list[int],
                       retries: int, migrations: int, first_token_by: float,
                       first_token_timeout_s: float) -> tuple[int, int]:
        """An attempt on decode worker `worker_id` (`decode`, while the directory lists it)
        failed with `exc`, a worker failure, the client holding `streamed`: raise what the
        client hears, or count a retry (nothing streamed yet) or a migration and return the
        new (retries, migrations) for the next attempt."""
        cfg = self.config
        code = code_of(exc)
        if isinstance(exc, OverloadedError) or code == ErrorCode.FIRST_TOKEN_DEADLINE:
            raise exc  # refused, or its deadline is spent: another placement cannot help
        if not streamed and time.monotonic() >= first_token_by:
            # The worker's stream ran out the request's first-token budget: that is the
            # deadline, not a worker to avoid (nor "no decode worker" with one).
            raise WorkerTimeoutError(
                f"no first token within {first_token_timeout_s:.0f}s, the request's "
                f"deadline (decode worker {worker_id}: {describe(exc)})",
                code=ErrorCode.FIRST_TOKEN_DEADLINE) from exc
        if not streamed:
            retries += 1
            if retries >= cfg.max_decode_attempts:
                if isinstance(exc, PdserveError):
                    raise exc
                # A worker call past its deadline: the worker is busy or gone, not the
                # request wrong; the client may retry (503), it is not a 504/500.
                raise WorkerTimeoutError(f"decode worker {worker_id} did not answer in "
                                         f"time: {describe(exc)}") from exc
            self.metrics.retries.inc()
            return retries, migrations
        if decode is not None:
            self._abort_on(self._channels.decode(decode),
                           self._worker_ids.get(req.request_id, req.request_id))
        if migrations >= cfg.max_migrations:
            log.warning("migration_exhausted", request_id=req.request_id,
                        migrations=migrations, error=describe(exc))
            raise CapacityError(
                f"decode worker {worker_id} failed mid-stream after {len(streamed)} tokens "
                f"and the request already moved {migrations} times: {describe(exc)}",
                code=ErrorCode.MIGRATION_EXHAUSTED) from exc
        migrations += 1
        self.metrics.migrations.labels(code).inc()
        log.warning("stream_migrating", request_id=req.request_id, from_worker=worker_id,
                    resumed_tokens=len(streamed), migration=migrations, error=describe(exc))
        return retries, migrations

    async def _attempt(self, req: GenerateRequest, decode: WorkerInfo, prefill: WorkerInfo | None,
                       decision: Decision, clock: StageClock, first_token_timeout_s: float, *,
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
                    "deadline", code=ErrorCode.FIRST_TOKEN_DEADLINE)
            return left

        dclient = self._channels.decode(decode)
        route = decision.route
        def lost() -> WorkerLostError:
            return WorkerLostError(f"decode worker {decode.worker_id} is lost")

        if route is Route.REMOTE and prefill is not None:
            try:
                async with contextlib.aclosing(self.liveness.watch(decode, remote_prefill(
                        req, dclient, self._channels.prefill(prefill), clock,
                        timeouts=self.config.remote, liveness=self.liveness,
                        abort_on=self._abort_on, timed=timed, budget_s=budget(),
                        expected_s=self._prefill_wait_s(prefill)), lost)) as events:
                    async for ev in events:
                        yield self._tag(ev, route, clock, decode, prefill)
                return
            except RemotePrefillFailed as exc:
                self.metrics.fallbacks.labels(exc.code).inc()
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
        async with contextlib.aclosing(self.liveness.watch(decode, dclient.generate(
                req, first_token_timeout_s=budget(),
                token_timeout_s=self.config.token_timeout_s), lost)) as events:
            async for ev in events:
                if first and timed:
                    clock.first_token()
                first = False
                yield self._tag(ev, route, clock, decode,
                                prefill if route is Route.FALLBACK else None,
                                request_id=client_id)

    @staticmethod
    def _tag(ev: TokenEvent, route: Route, clock: StageClock, decode: WorkerInfo,
             prefill: WorkerInfo | None, request_id: str | None = None) -> TokenEvent:
        """Tag events with where they ran (and the client's request id); the last one also
        gets the stage timings."""
        extra: dict[str, object] = {
            "route": route.value, "decode_worker": decode.worker_id,
            "prefill_worker": prefill.worker_id if prefill else None}
        if request_id is not None:
            extra["request_id"] = request_id
        if ev.finished:
            extra["timings"] = clock.finish()
        return dataclasses.replace(ev, **extra)  # type: ignore[arg-type]

    async def abort(self, request_id: str) -> bool:
        worker_id = self.ledger.worker_of(request_id)
        w = self.directory.get(worker_id) if worker_id else None
        if w is None:
            return False
        return await self._channels.decode(w).abort(self._worker_ids.get(request_id, request_id))


__all__ = ["FinishReason", "Resumed", "Router", "RouterConfig"]
