"""Placement by predicted cost: which decode worker, and local or remote prefill (on which
prefill worker), from what the workers are measured to do.

For a prompt of L tokens, decode worker w holding c_w of them in its prefix cache and prefill
worker p holding c_p in its own (both from the router's KV index, router.kv_index):

- local on w:   TTFT = (w's prompt tokens still to prefill + (L - c_w)) / w's prefill rate
                       + one decode step;
                and every stream running on w waits for those chunks: a stall of
                ((L - c_w) - absorbed) / rate seconds each, where a decode step absorbs up to
                `absorbed_tokens` prompt tokens at little cost (it is bound by reading the
                weights, not by arithmetic).
- remote via p, decode on w:
                TTFT = (p's queued + unfinished prompt tokens + (L - c_p)) / p's prefill rate
                       + (L - c_w) x p's transfer seconds per token + a fixed hand-off
                       + one decode step on w; no stall on w, unless p shares w's CPUs
                (the same host, overlapping CPU sets: `WorkerInfo.shares_cpus`; `pdserve
                cluster up` puts a prefill worker on every CPU at a lower priority): then
                its compute takes the cores w's streams run on, and they stall as if w
                computed those tokens itself, by the share of the CPUs it takes from them
                (`WorkerInfo.stall_share`: at nice 5 beside w at nice 0, a third); and p
                computes only after w's own queued prompt work (w's priority), so that is
                in its TTFT too. On one shared host a remote prefill adds no compute, but
                at a lower priority it stalls w's streams less than a local one. p's
                rate is priced for the threads it will run (`cpu_factor`): where a busy
                worker beside it (decode workers running streams or prefilling) computes
                on some of the CPUs p may use, a thread per CPU left free; with none
                free, one thread at the share of a CPU the kernel gives it there
                (`WorkerInfo.cpu_share_beside`: a quarter at nice 5 beside nice 0), for
                `contention_horizon_s`, then as with nothing busy beside it: on
                `pdserve cluster up`'s 1P2D layout, two decode workers each running a
                stream held a 120-token prompt on the prefill worker 1.4 s, not 0.3. A p
                that adapts its threads (`EngineConfig.adapt_threads`, as `cluster up`
                starts it) computes a short prompt (under `free_cpus.LONG_STEP_TOKENS`)
                on one thread even on free CPUs: at about half its two-thread rate.
                p computes what *its* cache lacks; only the blocks w lacks cross the wire.
- either way, the stream then decodes on w: its TPOT is w's measured decode step, grown by
  `decode_row_fraction` of it for each stream more than w ran when it measured (the ones
  this router placed there since count: `streams`).

Rates come from the workers' load records (pdserve.engine.step_rates: moving averages of
their own steps and transfers), refreshed by heartbeats; what this router sent since the last
heartbeat is added on top (`inflight_tokens`, `streams`: router.ledger), so a burst does not
all pick the worker that looked idle a second ago. A worker that has measured no prefill yet
is assumed to prefill as fast as the slowest worker that has (`peer_prefill_rate`); until
any has, conservative priors stand in (a slow prefill), so early decisions do not
over-promise.

The choice, over every candidate (local on each w; remote on each w via its best p): the
least cost = the class's TTFT weight x (TTFT + late_weight x (TTFT past the latency
class's target: `RouterPolicy.ttft_targets_s`, well below the admission deadline)) +
stall_weight x (stall summed over w's running streams) + tpot_weight x TPOT. The TTFT
weight (`RouterPolicy.ttft_weights`) is 1 but for batch prompts, whose wait is worth a
tenth: a 1,146-token batch prompt prefilled beside four running streams on
`pdserve cluster up --prefill 1 --decode 2` got its first token in 3 s instead of 11 s
through the busy prefill worker, and stretched their TPOT p99 from 74-84 ms to 123-129 ms
(docs/bench/placement_s62). The target is priced, not a wall: predictions err (a
hard cut at the target kept every remote prefill of bench.cluster_sim's chat workload out,
predicted at just over 1 s, and lost attainment), yet a queue far past it loses to any
candidate near it (bench.serve_compare at c=16: a remote queue that fit the 30 s deadline
took 26 s). A local prefill longer than `max_local_prefill_s` is taken only
when remote would miss the target: it would hold up whoever arrives at w in the meantime (the
model cannot see arrivals; bench.goodput run 2 showed it). A worker holding more of the
prompt has less to prefill, so the prediction itself rewards cache affinity. Plain
arithmetic, no I/O: these functions are the scalar reference; router.placement evaluates the
same formulas over arrays (held equal by tests/test_router_cost.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.control.load import WorkerLoad
from pdserve.engine.free_cpus import threads_for
from router.policy import Decision, Route


@dataclass(frozen=True)
class CostModel:
    prior_prefill_tokens_per_s: float = 250.0
    prior_decode_step_s: float = 0.05
    prior_transfer_s_per_token: float = 2e-4
    # allocate + prefill dispatch + admission on arrival; the router adds the median miss it
    # measures on remote requests (router.calibration.RemoteOverhead)
    remote_overhead_s: float = 0.02
    # Seconds of TTFT one second of stall on one running stream is worth.
    stall_weight: float = 2.0
    absorbed_tokens: int = 64
    # Longest local prefill (seconds of compute) the model prefers to a remote one that meets
    # the target: about an interactive TTFT target, since it blocks the next arrivals.
    max_local_prefill_s: float = 1.0
    # Each stream more in a decode batch lengthens its step by this fraction of the step
    # measured (a decode step mostly reads the weights once: rows are cheap; this CPU's
    # profile, bench.engine_profile: ~6 % a row at 8 rows).
    decode_row_fraction: float = 0.06
    # Seconds of TTFT one second of the request's predicted TPOT is worth: what spreads decode
    # streams over the workers. In bench.cluster_sim probes (chat, 16 and 64 decode workers)
    # values from 2 to 16 changed attainment little; lower ones kept more cache affinity.
    tpot_weight: float = 2.0
    # Seconds of cost per second of predicted TTFT past the class's target (on top of the
    # TTFT itself): at 4, a queue predicted 3 s past the target costs 12 s more than one
    # that meets it, about the stall cost of a 200-token local prefill on 12 running
    # streams on a 2-core Zen 3 (2 x 12 x 0.51 s).
    late_weight: float = 4.0
    # Seconds the workers busy now are expected to stay busy: a prefill worker whose CPUs
    # they want computes that long at its share of a CPU (`cpu_factor`), then at its measured
    # rate. About an interactive stream's life (~40 tokens at ~50 ms): a 120-token prompt
    # is priced at the share throughout, a 1,146-token batch prompt mostly at its rate.
    contention_horizon_s: float = 2.0

    def prefill_rate(self, load: WorkerLoad, peer_rate: float | None = None) -> float:
        """`load`'s measured rate; if it measured none, `peer_rate` (`peer_prefill_rate`),
        else the prior."""
        return load.prefill_tokens_per_s or peer_rate or self.prior_prefill_tokens_per_s

    def decode_step(self, load: WorkerLoad) -> float:
        return load.decode_step_s or self.prior_decode_step_s

    def tpot(self, load: WorkerLoad, streams: float) -> float:
        """A new stream's time per token on a worker that will run `streams` others."""
        return self.decode_step(load) * (
            1.0 + self.decode_row_fraction * max(0.0, streams + 1.0 - load.running))


@dataclass(frozen=True)
class Estimate:
    route: Route
    ttft_s: float
    stall_s: float  # summed over the decode worker's running streams
    compute_s: float = 0.0  # the prefill's own compute where it runs
    tpot_s: float = 0.0  # the new stream's, on its decode worker

    def cost(self, model: CostModel, target_s: float = math.inf, weight: float = 1.0
             ) -> float:
        """`weight`: what a second of this class's TTFT is worth (`RouterPolicy.ttft_weights`)."""
        return (weight * (self.ttft_s + model.late_weight * max(0.0, self.ttft_s - target_s))
                + model.stall_weight * self.stall_s + model.tpot_weight * self.tpot_s)


def peer_prefill_rate(loads: Iterable[WorkerLoad]) -> float | None:
    """The slowest prefill rate any of the workers measured (None: none did): what a worker
    that has measured nothing yet is assumed to do. The workers serve one model, so a peer's
    measurement is a better guess than the prior; without it a decode worker that never
    prefilled would keep the prior's slow rate, look too costly to prefill locally, and so
    never measure (bench/serve_compare, cost placement at c=16: every prompt went to one
    prefill worker)."""
    return min((r for load in loads if (r := load.prefill_tokens_per_s)), default=None)


def prefill_capacity(loads: Iterable[WorkerLoad], model: CostModel) -> float:
    """Prompt tokens per second the workers can prefill together: each one's measured rate,
    a peer's (`peer_prefill_rate`) or the prior where it has none (admission control starts
    from this; router.admission)."""
    loads = list(loads)
    peer = peer_prefill_rate(loads)
    return sum(model.prefill_rate(load, peer) for load in loads)


def cpu_factor(measured_share: float | None, cpus: int, beside_busy: Iterable[float],
               busy_cpus: float | None = None, *, threads: int = 0, adapt: bool = False,
               long_prompt: bool = True) -> float:
    """What a prefill worker's measured rate is multiplied by for the CPUs it will find now:
    `cpus`, how many CPUs it may run on (0: unknown, nothing is assumed); `beside_busy`, the
    share of a CPU it gets beside each busy worker that competes for them
    (`WorkerInfo.cpu_share_beside`); `busy_cpus`, how many of its CPUs those workers compute
    on (`WorkerInfo.cpus_shared`; default: one each); `threads`, its torch threads
    (`WorkerInfo.threads`; 0: one per CPU).

    Its threads each take a CPU the busy ones leave free; with none free, one thread computes
    at the best of those shares. One that adapts its threads (`adapt`:
    `EngineConfig.adapt_threads`, as `pdserve cluster up` starts it) runs a step of a long
    prompt (`long_prompt`: `free_cpus.LONG_STEP_TOKENS` or more) on a thread per CPU left
    free, and any other step on one thread, even on an idle host. The CPUs it gets are over
    the share of its threads' CPUs it had while it measured (`WorkerLoad.prefill_cpu_share`;
    unknown: all of them): a rate measured on one thread of two is half the speed of two,
    and a rate measured beside the same busy workers is not slowed twice. A worker with
    fixed threads is never priced above its measured rate (and, with no busy worker beside
    it, at that rate): an adapting one is, as a long prompt on free CPUs runs on more
    threads than the short ones it may have measured on (a 2-vCPU Zen 4: 1.9x)."""
    shares = list(beside_busy)
    if not cpus or not (shares or adapt):
        return 1.0
    most = threads or cpus
    taken = min(float(cpus), len(shares) if busy_cpus is None else busy_cpus)
    free = cpus - taken
    n = (threads_for(free, most) if long_prompt else 1) if adapt else most
    have = min(n, free) if free > 0 else max(shares)
    factor = have / (most * (measured_share or 1.0))
    return factor if adapt else min(1.0, factor)


def contended_factor(factor: float, work_s: float, horizon_s: float, after: float = 1.0
                     ) -> float:
    """The rate factor for `work_s` seconds of compute (at the measured rate) that runs at
    `factor` (`cpu_factor`) for the first `horizon_s` seconds, then at `after` (the factor
    with nothing busy beside it)."""
    if factor >= after or work_s <= factor * horizon_s:
        return factor
    return work_s / (horizon_s + (work_s - factor * horizon_s) / after)


def local_estimate(decode: WorkerLoad, uncached: int, model: CostModel, *,
                   inflight_tokens: float = 0.0, streams: float | None = None,
                   peer_rate: float | None = None) -> Estimate:
    """`uncached`: prompt tokens w lacks; `streams`: what runs on w now (default: its last
    heartbeat's count; the router passes the larger of that and what it placed there);
    `peer_rate`: the rate assumed if w measured none (`peer_prefill_rate`)."""
    n = decode.running if streams is None else streams
    rate = model.prefill_rate(decode, peer_rate)
    pending = max(decode.waiting_prompt_tokens or 0.0, inflight_tokens)
    stall = max(0, uncached - model.absorbed_tokens) / rate
    return Estimate(Route.LOCAL, (pending + uncached) / rate + model.decode_step(decode),
                    stall * n, uncached / rate, model.tpot(decode, n))


def pending_prefill_tokens(prefill: WorkerLoad, sent_tokens: float) -> float:
    """Prompt tokens a prefill worker has to compute before a prompt placed on it now: the
    larger of its last published queue (queued at its gate and waiting in its engine) and
    what one router sent it and has no first token for (`sent_tokens`:
    `PlacementLedger.inflight_tokens`; the heartbeat lags the router's own placements)."""
    return max(prefill.queued_tokens + (prefill.waiting_prompt_tokens or 0.0), sent_tokens)


def remote_estimate(prefill: WorkerLoad, decode: WorkerLoad, uncached: int, model: CostModel,
                    *, inflight_tokens: float = 0.0, prefill_uncached: int | None = None,
                    streams: float | None = None, peer_rate: float | None = None,
                    shares_cpus: float = 0.0, decode_inflight_tokens: float = 0.0,
                    rate_factor: float = 1.0, idle_factor: float = 1.0) -> Estimate:
    """`uncached`: prompt tokens the decode worker lacks (transferred); `prefill_uncached`:
    the ones the prefill worker lacks (computed; default: the same); `shares_cpus` (above 0):
    the prefill worker computes on the decode worker's CPUs, after the decode worker's own
    queued prompt work (`decode_inflight_tokens`: what this router sent it), and its streams
    stall as if the decode worker computed those tokens, times this share of the CPUs it
    takes from them (`WorkerInfo.stall_share`: 1 at equal priority); `rate_factor`: the
    prefill worker's rate for the CPUs it finds now (`cpu_factor`), for as long as
    `model.contention_horizon_s`, then `idle_factor`, its rate with nothing busy beside it
    (`contended_factor`)."""
    n = decode.running if streams is None else streams
    computed = uncached if prefill_uncached is None else prefill_uncached
    rate = model.prefill_rate(prefill, peer_rate)
    pending = pending_prefill_tokens(prefill, inflight_tokens)
    rate *= contended_factor(rate_factor, (pending + computed) / rate,
                             model.contention_horizon_s, idle_factor)
    transfer = uncached * (prefill.kv_transfer_s_per_token or model.prior_transfer_s_per_token)
    ttft = ((pending + computed) / rate + transfer + model.remote_overhead_s
            + model.decode_step(decode))
    stall = 0.0
    if shares_cpus:
        decode_rate = model.prefill_rate(decode, peer_rate)
        ttft += max(decode.waiting_prompt_tokens or 0.0, decode_inflight_tokens) / decode_rate
        stall = max(0, computed - model.absorbed_tokens) / decode_rate * n * shares_cpus
    return Estimate(Route.REMOTE, ttft, stall, computed / rate, model.tpot(decode, n))


def decide_by_cost(local: Estimate, remote: Estimate | None, uncached: int, target_s: float,
                   model: CostModel, weight: float = 1.0) -> tuple[Decision, Estimate]:
    """`remote` is None when no prefill worker is available; `weight`: the class's TTFT
    weight (`Estimate.cost`)."""
    if remote is None:
        return Decision(Route.LOCAL, "no_prefill_worker", uncached), local
    candidates = [local, remote]
    if remote.ttft_s <= target_s and local.compute_s > model.max_local_prefill_s:
        candidates = [remote]
    best = min(candidates, key=lambda e: e.cost(model, target_s, weight))
    reason = f"cost_{best.route.value}" if best.ttft_s <= target_s else "cost_over_target"
    return Decision(best.route, reason, uncached), best
