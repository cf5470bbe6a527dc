"""The simulated cluster: workers (bench.sim.workers), the router's real placement code, the
heartbeats it reads and the KV events that feed its prefix index, on one event queue.

Per request, as router/router.py does: `router.placement.place` (threshold or cost) or a
baseline decode chooser, over `WorkerInfo`s whose `WorkerLoad` is each worker's last
heartbeat (every `heartbeat_s`, so up to a second stale), with the router's own `placed`
counts and in-flight prompt tokens (`_set_placement` / `_charge`) on top; the prefix index is
a real `KVIndex` fed by each decode worker's `BlockManager` events `event_lag_s` after they
happen. Remote: allocate on the decode worker (refused: local, as the router falls back),
prefill on the prefill worker, transfer, admission. Deterministic for a seed: one heap
ordered by (time, sequence number), one seeded RNG.
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from bench.loadgen.config import SLO
from bench.loadgen.metrics import RequestResult, RunSummary, summarize
from bench.sim.workers import (
    BLOCK_BYTES,
    DECODE_KINDS,
    MODEL_ID,
    Clock,
    DecodeSim,
    Host,
    PrefillSim,
    Progress,
    SimRequest,
    SimWorker,
    StepCost,
    load_corun,
)
from pdserve.cluster import DEFAULT_PREFILL_NICE
from pdserve.control.workers import WorkerInfo
from pdserve.engine.config import EngineConfig
from pdserve.engine.free_cpus import WINDOW_S
from pdserve.kv_events import KVEventBatch
from router import placement
from router.admission import AdmissionConfig
from router.calibration import RemoteOverhead
from router.config import RouterConfig
from router.cost import CostModel, peer_prefill_rate
from router.kv_index import KVIndex
from router.ledger import PlacementLedger
from router.policy import Decision, Route, RouterPolicy, decide_route
from router.remote import RemoteTimeouts, prefill_lease_s, prefill_wait_s, progress_cap_s

Policy = Literal["threshold", "cost", "least-loaded", "random", "round-robin"]
POLICIES: tuple[Policy, ...] = ("threshold", "cost", "least-loaded", "random", "round-robin")
# How the workers share CPUs: "own" (a machine each), "1p1d" (bench.goodput: prefill pinned
# to core 0, decode to core 1), "cluster-up" (pdserve cluster up on 2 cores: decode i pinned
# to core i, prefill unpinned at nice 5).
Sharing = Literal["own", "1p1d", "cluster-up"]
SHARED_CORES = 2  # the host of the 1p1d and cluster-up layouts
NICE_5 = 335.0  # CFS weight of nice 5 (nice 0: 1024)


@dataclass(frozen=True)
class Overheads:
    """Time outside the engine steps, calibrated from unloaded requests (bench.cluster_sim)."""

    local_s: float = 0.0  # client -> decode engine: HTTP, router, gRPC (and back)
    remote_s: float = 0.0  # client -> prefill engine, allocate RPC and hand-off included
    step_s: float = 0.0  # per engine step outside the model: the event loop
    # Per token a decode worker streams: gRPC, router, gateway and client work that competes
    # for the same cores (calibrated from closed-loop runs: bench.sim.real streaming).
    token_s: float = 0.0
    transfer_s_per_token: float = 1e-4
    # Per context token of each decode row, beyond the profile's own context term: reading a
    # long sequence's KV in a running cluster costs more than in the profile's lone engine
    # (calibrated from one-at-a-time chat vs long-batch TPOT, bench.cluster_sim.calibrate).
    context_s_per_token: float = 0.0
    # A prefill worker's step in the running cluster over the profile's price of it, and the
    # CPU weight an unpinned prefill worker competes with (cluster-up: nice 5), calibrated
    # from long prompts sent one at a time, idle and beside streams (bench.sim.real prefill).
    prefill_factor: float = 1.0
    prefill_weight: float = NICE_5
    # A prefill step's slowdown while a decode worker computes on another core of the host,
    # on top of the engines' own (`SimConfig.corun`): in a running cluster the router,
    # gateway, client and Redis share the cores too (calibrated as above).
    prefill_beside_decode: float = 1.0
    # The share of the co-run table's slowdown of a decode step (beside anything) that the
    # running cluster shows: 1 + share x (table - 1). The table times two engines each in a
    # tight loop on its core; two decode workers streaming in `pdserve cluster up`'s 1P2D
    # may slow each other less (calibrated from its closed-loop streams: bench.sim.real
    # streaming --layout 1p2d).
    corun_share: float = 1.0
    # An unpinned prefill worker's speed on all the CPUs its threads may use over one CPU's
    # (cluster-up: a thread per core; bench.sim.workers.SimWorker.speedup): its idle
    # prompts' compute on 1P1D (one thread, one core) over on 1P2D; 0: perfect scaling.
    prefill_speedup: float = 0.0


@dataclass(frozen=True)
class SimConfig:
    n_decode: int = 1
    n_prefill: int = 1
    policy: Policy = "threshold"
    router: RouterPolicy = field(default_factory=RouterPolicy)
    cost: CostModel = field(default_factory=CostModel)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    sharing: Sharing = "own"
    overheads: Overheads = field(default_factory=Overheads)
    # the engine's default pool (EngineConfig.kv_cache_bytes, 2 GiB) of SmolLM2-135M float32
    # blocks (737,280 bytes each)
    num_blocks: int = EngineConfig().kv_cache_bytes // BLOCK_BYTES
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 512
    # The engines' --step-target-ms (0: the token budget alone), by default the engine's.
    step_target_ms: float = EngineConfig().step_target_ms
    interactive_step_target_ms: float = EngineConfig().interactive_step_target_ms
    max_num_seqs: int = 64
    # The router's --remote-overhead-window (policy cost: the fixed cost of a remote prefill
    # corrected by the median miss of its measured allocation + hand-off,
    # router.calibration); 0: off.
    remote_overhead_window: int = RouterConfig().remote_overhead_window
    # The router's --prefill-timeout and --max-prefill-timeout: the decode worker's lease on
    # blocks reserved for a remote prefill, stretched to cover the prefill worker's queue as
    # the router does (router.remote.prefill_lease_s; a ceiling at the floor: routers before
    # 4c19bbe, whose lease was --prefill-timeout). Each part of the KV that lands renews it,
    # up to router.remote.progress_cap_s (`lease_renews`; False: routers and decode workers
    # before it, whose lease ended at its first deadline). KV that has not landed by then
    # fails the transfer, and the router prefills the prompt on the decode worker (route
    # "fallback"); 0: no lease.
    remote_lease_s: float = RouterConfig().prefill_timeout_s
    max_remote_lease_s: float = RouterConfig().max_prefill_timeout_s
    lease_renews: bool = True
    heartbeat_s: float = 1.0
    event_lag_s: float = 0.05  # publisher (<= 20 ms batches) + XREAD + apply
    # Stop this long after the last arrival even if requests are left (reported unfinished):
    # heartbeats never stop, so a request that could never finish must not hang the run.
    drain_limit_s: float = 3600.0
    # Two-core hosts (1p1d, cluster-up): slowdown of a step while the other core computes,
    # (step kind, other kind) -> factor (bench.engine_profile --corun); None: measured file.
    corun: dict[tuple[str, str], float] | None = None
    # Threads of an unpinned prefill worker (cluster-up; bench.sim.workers.Host: how they
    # share the cores); 0: as `pdserve cluster up` runs it, one per CPU of its host.
    prefill_threads: int = 0
    # Whether it runs a thread per core the others leave free (`--adapt-threads`, as
    # `pdserve cluster up` starts it from stop 75 on; records before ran all of them).
    prefill_adapt: bool = True
    # How an adapting worker sizes a step (bench.sim.workers.Host): by the CPU the others
    # took over about this many seconds, as the engine does; 0: by the cores nothing
    # computes on at each instant, resized mid-step (the simulator before stop 77).
    free_window_s: float = WINDOW_S
    # A step on several threads, one of which shares a core, advances as one thread at that
    # thread's share (Host); False: by the sum of its threads' shares (before stop 77).
    barrier: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.n_decode < 1 or self.n_prefill < 0:
            raise ValueError("need >= 1 decode worker and >= 0 prefill workers")
        if self.sharing != "own" and (self.n_prefill, self.n_decode) not in ((1, 1), (1, 2)):
            raise ValueError(f"sharing {self.sharing!r} models 1P1D or 1P2D on 2 cores only")


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    requests: tuple[RequestResult, ...]
    summary: RunSummary
    prefix_hit_rate: float  # prompt tokens served from the decode workers' caches
    # Prompt tokens the worker that prefilled them had cached (the decode worker's for a
    # local prefill, the prefill worker's for a remote one): 1 - the share recomputed.
    prefill_hit_rate: float
    routes: dict[str, int]
    decisions: list[tuple[str, str, str]]  # per request (decode worker, route, reason)
    leaked_blocks: int  # blocks held by a request after the run (0: every block freed)

    @property
    def goodput_rps(self) -> float:
        """Requests per second that met both SLOs."""
        s = self.summary
        return s.overall.attainment.both * s.num_sent / s.duration_s if s.duration_s else 0.0


class Simulation(Clock):
    def __init__(self, config: SimConfig, cost: StepCost):
        self.config = config
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._count = itertools.count()
        self.rng = random.Random(config.seed)
        c = config
        self._timeouts = RemoteTimeouts(prefill_timeout_s=c.remote_lease_s,
                                        max_prefill_timeout_s=c.max_remote_lease_s)
        hosts: list[Host] = []

        corun = dict(load_corun() if c.corun is None else c.corun)
        if c.overheads.corun_share != 1.0:
            corun = {k: 1.0 + c.overheads.corun_share * (v - 1.0)
                     if k[0] in DECODE_KINDS else v for k, v in corun.items()}
        if c.overheads.prefill_beside_decode != 1.0:
            key = ("prefill", "decode")
            corun[key] = corun.get(key, 1.0) * c.overheads.prefill_beside_decode

        def host() -> Host:
            if c.sharing == "own" or not hosts:
                hosts.append(Host(1) if c.sharing == "own" else
                             Host(SHARED_CORES, corun, window_s=c.free_window_s,
                                  barrier=c.barrier))
            return hosts[-1]

        kw: dict[str, Any] = dict(num_blocks=c.num_blocks, block_size=c.block_size,
                  max_num_batched_tokens=c.max_num_batched_tokens,
                  max_prefill_chunk=c.max_prefill_chunk, max_num_seqs=c.max_num_seqs,
                  step_target_ms=c.step_target_ms,
                  interactive_step_target_ms=c.interactive_step_target_ms,
                  step_overhead_s=c.overheads.step_s,
                  context_overhead_s=c.overheads.context_s_per_token)
        dkw = dict(kw, token_overhead_s=c.overheads.token_s)
        self.decoders = [DecodeSim(f"decode-{i:03d}", self, cost, host(),
                                   core=0 if c.sharing == "own" else
                                   (1 if c.sharing == "1p1d" else i),
                                   on_token=self._token, on_finish=self._finish,
                                   on_step=self._publish, **dkw)
                         for i in range(c.n_decode)]
        self.prefills = [PrefillSim(f"prefill-{i:03d}", self, cost, host(),
                                    core=0 if c.sharing in ("own", "1p1d") else None,
                                    threads=c.prefill_threads or SHARED_CORES // c.n_prefill,
                                    speedup=c.overheads.prefill_speedup,
                                    adapt_threads=c.prefill_adapt,
                                    weight=(c.overheads.prefill_weight
                                            if c.sharing == "cluster-up" else 1024.0),
                                    transfer_s_per_token=c.overheads.transfer_s_per_token,
                                    prefill_factor=c.overheads.prefill_factor,
                                    on_step=self._publish, **kw)
                         for i in range(c.n_prefill)]
        self.by_id: dict[str, SimWorker] = {w.worker_id: w
                                            for w in [*self.decoders, *self.prefills]}
        # Where each computes, as a real worker publishes it: its host, its core (an
        # unpinned one may run on every core of its host), its nice value and its threads,
        # so cost placement sees sharing and prices it by the scheduler's share.
        self.infos = {w.worker_id: WorkerInfo(
            worker_id=w.worker_id, role="decode" if isinstance(w, DecodeSim) else "prefill",
            grpc_address=f"127.0.0.1:{20000 + i}", model_id=MODEL_ID, epoch=1, started_at=0.0,
            load=w.load(), host_id=f"host-{hosts.index(w.host)}",
            cpus=tuple(range(w.host.cores)) if w.core is None else (w.core,),
            nice=DEFAULT_PREFILL_NICE if c.sharing == "cluster-up"
            and isinstance(w, PrefillSim) else 0,
            threads=w.threads, adapt_threads=w.adapt_threads)
            for i, w in enumerate(self.by_id.values())}
        # One index for both roles, as the router keeps it: prefill workers publish too.
        self.index = KVIndex()
        self._event_seq = dict.fromkeys(self.by_id, 1)
        for worker_id in self.by_id:
            self.index.apply(worker_id, KVEventBatch(1, 1, c.block_size, (), snapshot=True))
        self.ledger = PlacementLedger(lambda: self.now)  # the router's in-flight accounting
        self.remote_overhead = (RemoteOverhead.of_window(c.remote_overhead_window)
                                if c.policy == "cost" else None)
        self._cost = c.cost
        for d in self.decoders:
            d.on_landed = self._landed
        self.placed = self.ledger.placed
        self.inflight_tokens = self.ledger.inflight_tokens
        self._tiebreak = itertools.count()
        self.progress: dict[str, Progress] = {}
        self.decisions: list[tuple[str, str, str]] = []
        self._unfinished = 0

    # ------------------------------------------------------------------ the event loop

    def at(self, t: float, fn: Callable[[], object]) -> None:
        heapq.heappush(self._heap, (t, next(self._count), fn))

    def run(self, requests: Sequence[SimRequest], slo: SLO) -> SimResult:
        for r in requests:
            self.at(r.arrival_s, functools.partial(self._arrive, r))
        for w in self.by_id.values():  # heartbeats at a random phase each, then every period
            self.at(self.rng.uniform(0, self.config.heartbeat_s),
                    functools.partial(self._heartbeat, w))
        self._unfinished = len(requests)
        horizon = max((r.arrival_s for r in requests), default=0.0) + self.config.drain_limit_s
        while self._heap and self._unfinished:
            t, _, fn = heapq.heappop(self._heap)
            if t > horizon:
                break
            self.now = t
            fn()
        return self._result(requests, slo)

    def _heartbeat(self, w: SimWorker) -> None:
        load = w.load()
        self.infos[w.worker_id] = self.infos[w.worker_id].with_load(load)
        # Seen at once, and exact: what the router placed before the way to the worker.
        self.ledger.saw_loads([(w.worker_id, load)], self.config.overheads.local_s,
                              complete=False)
        self.at(self.now + self.config.heartbeat_s, functools.partial(self._heartbeat, w))

    def _publish(self, d: SimWorker) -> None:
        ops = d.bm.drain_events()
        if not ops:
            return
        self._event_seq[d.worker_id] += 1
        batch = KVEventBatch(1, self._event_seq[d.worker_id], self.config.block_size,
                             tuple((op, bytes(h)) for op, h in ops))
        self.at(self.now + self.config.event_lag_s,
                functools.partial(self.index.apply, d.worker_id, batch))

    # ------------------------------------------------------------------ the router

    def _arrive(self, req: SimRequest) -> None:
        c = self.config
        p = self.progress[req.rid] = Progress(req)
        decoders = [self.infos[d.worker_id] for d in self.decoders]
        prefills = [self.infos[w.worker_id] for w in self.prefills]
        tiebreak = next(self._tiebreak)
        if c.policy in ("threshold", "cost"):
            router_policy = RouterPolicy(**{**c.router.__dict__, "placement": c.policy})
            pl = placement.place(req.ids, req.latency_class, decoders, prefills, self.index,
                                 self.placed, router_policy, cost=self._cost,
                                 target_s=router_policy.ttft_target_s(
                                     req.latency_class, c.admission.deadline_s(req.latency_class)),
                                 inflight_tokens=self.inflight_tokens, tiebreak=tiebreak,
                                 finished=self.ledger.finished)
            decode_info, prefill_info, decision = pl.decode, pl.prefill, pl.decision
            if self.remote_overhead is not None and decision.route is Route.REMOTE:
                p.priced_step_s = decode_info.load.decode_step_s
        else:
            decode_info = decoders[self._baseline(decoders, tiebreak)]
            cached = placement.cached_tokens(self.index, req.ids, [decode_info])[0]
            prefill_info = min(prefills, key=lambda w: (w.load.queued_tokens, w.load.running)
                               ) if prefills else None
            backlog = None if prefill_info is None else prefill_info.load.queued_tokens
            decision = decide_route(len(req.ids), cached, req.latency_class, backlog,
                                    c.router)
        self._dispatch(req, p, decode_info, prefill_info, decision)

    def _baseline(self, decoders: list[WorkerInfo], tiebreak: int) -> int:
        n = len(decoders)
        if self.config.policy == "random":
            return self.rng.randrange(n)
        if self.config.policy == "round-robin":
            return tiebreak % n
        loads = [max(w.load.running, self.placed.get(w.worker_id, 0)) + w.load.backlog
                 for w in decoders]  # least-loaded, as the router counts load; ties rotate
        least = min(loads)
        return next(i % n for i in range(tiebreak, tiebreak + n) if loads[i % n] == least)

    def _dispatch(self, req: SimRequest, p: Progress, decode_info: WorkerInfo,
                  prefill_info: WorkerInfo | None, decision: Decision) -> None:
        decode = self.by_id[decode_info.worker_id]
        assert isinstance(decode, DecodeSim)
        self.decisions.append((decode.worker_id, decision.route.value, decision.reason))
        self.ledger.place(req.rid, decode.worker_id)
        p.decode = decode.worker_id
        o = self.config.overheads
        if decision.route is Route.REMOTE and prefill_info is not None:
            seq = decode.allocate_remote(req)
            if seq is not None:
                prefill = self.by_id[prefill_info.worker_id]
                assert isinstance(prefill, PrefillSim)
                p.route, p.prefill = "remote", prefill.worker_id
                self.ledger.charge(req.rid, prefill.worker_id, decision.uncached_tokens)
                self.at(self.now + o.remote_s,
                        functools.partial(prefill.submit, req, seq.num_cached_tokens, decode))
                if self.config.remote_lease_s:
                    peer = peer_prefill_rate(w.load for w in self.infos.values())
                    lease = prefill_lease_s(self._timeouts, prefill_wait_s(
                        prefill_info.load,
                        self.ledger.inflight_tokens.get(prefill.worker_id, 0.0),
                        self._cost.prefill_rate(prefill_info.load, peer)))
                    cap = progress_cap_s(self._timeouts, lease) \
                        if self.config.lease_renews else lease
                    self.at(self.now + lease, functools.partial(
                        self._lease_over, req, p, decode, prefill, decision.uncached_tokens,
                        lease, self.now + cap))
                return
            p.route = "fallback"
        p.route = p.route or "local"
        self.ledger.charge(req.rid, decode.worker_id, decision.uncached_tokens)

        self.at(self.now + o.local_s, functools.partial(decode.add_local, req))

    def _lease_over(self, req: SimRequest, p: Progress, decode: DecodeSim,
                    prefill: PrefillSim, uncached: int, lease_s: float,
                    last_s: float) -> None:
        """The decode worker's lease on `req`'s blocks ran out, unless a part of its KV
        landed less than `lease_s` ago (then it runs on from that part, up to `last_s`):
        unless its KV landed, the transfer fails, the router cancels the prefill and
        prefills on the decode worker."""
        if not decode.awaits_kv(req.rid):
            return
        part = prefill.part_landed_s.get(req.rid)
        renewed = -1.0 if part is None else min(part + lease_s, last_s)
        if renewed > self.now:
            self.at(renewed, functools.partial(
                self._lease_over, req, p, decode, prefill, uncached, lease_s, last_s))
            return
        prefill.cancel(req.rid)
        decode.cancel_remote(req.rid)
        p.route, p.prefill = "fallback", ""
        self.ledger.charge(req.rid, decode.worker_id, uncached)
        self.at(self.now + self.config.overheads.local_s,
                functools.partial(decode.add_local, req))

    # ------------------------------------------------------------------ the client

    def _token(self, rid: str, t: float) -> None:
        p = self.progress[rid]
        if p.first_token_s is None:
            p.first_token_s = t
            self.ledger.charge(rid, None, 0)
            learner = self.remote_overhead
            if (learner is not None and p.route == "remote" and p.priced_step_s
                    and p.landed_s is not None):
                # The allocation is instant here; the dispatch is `remote_s`.
                fixed = self.config.overheads.remote_s + (t - p.landed_s)
                learner.observe(fixed, p.priced_step_s, self.config.cost)
                self._cost = learner.apply(self.config.cost)
        p.tokens += 1
        p.token_times.append(t)

    def _landed(self, rid: str, t: float) -> None:
        self.progress[rid].landed_s = t

    def _finish(self, rid: str, cached_tokens: int) -> None:
        p = self.progress[rid]
        p.finish_s = self.now
        p.cached_tokens = cached_tokens
        self._unfinished -= 1
        self.ledger.place(rid, None)

    def _result(self, requests: Sequence[SimRequest], slo: SLO) -> SimResult:
        results = []
        hit = total = computed_hit = 0
        routes: collections.Counter[str] = collections.Counter()
        for i, r in enumerate(requests):
            p = self.progress.get(r.rid)
            done = p is not None and p.finish_s is not None and p.first_token_s is not None
            if not done or p is None or p.first_token_s is None or p.finish_s is None:
                results.append(RequestResult(i, r.latency_class.value, len(r.ids), r.output_len,
                                             0, r.arrival_s, None, None, error="not finished"))
                continue
            routes[p.route] += 1
            hit += p.cached_tokens
            prefill = self.by_id.get(p.prefill)
            computed_hit += (prefill.cached_tokens.get(r.rid, 0) if p.route == "remote"
                             and isinstance(prefill, PrefillSim) else p.cached_tokens)
            total += len(r.ids)
            times = p.token_times
            results.append(RequestResult(
                i, r.latency_class.value, len(r.ids), r.output_len, p.tokens, r.arrival_s,
                p.first_token_s - r.arrival_s, p.finish_s - r.arrival_s,
                tuple(b - a for a, b in itertools.pairwise(times)), status=200,
                route=p.route))
        end = max((p.finish_s or 0.0) for p in self.progress.values()) if self.progress else 0.0
        leaked = sum(d.bm.num_blocks - d.bm.num_free_blocks for d in self.by_id.values())
        return SimResult(self.config, tuple(results), summarize(results, slo, end),
                         hit / total if total else 0.0,
                         computed_hit / total if total else 0.0, dict(routes), self.decisions,
                         leaked)


def simulate(config: SimConfig, requests: Sequence[SimRequest], slo: SLO,
             cost: StepCost | None = None) -> SimResult:
    return Simulation(config, cost or StepCost.load()).run(requests, slo)
