"""Local vs remote prefill by predicted cost, from what the workers are measured to do.

For a request whose prompt has `uncached` tokens not in decode worker w's cache:

- local on w:   TTFT = (w's prompt tokens still to prefill + uncached) / w's prefill rate
                       + one decode step;
                and every stream running on w waits for those chunks: a stall of
                (uncached - absorbed) / rate seconds each, where a decode step absorbs up to
                `absorbed_tokens` prompt tokens at little cost (it is bound by reading the
                weights, not by arithmetic).
- remote via p: TTFT = (p's queued + unfinished prompt tokens + uncached) / p's prefill rate
                       + uncached x p's transfer seconds per token + a fixed hand-off
                       + one decode step on w; no stall on w.

Rates come from the workers' load records (pdserve.engine.step_rates: moving averages of
their own steps and transfers), refreshed by heartbeats; what this router sent since the last
heartbeat is added on top (`inflight_tokens`), so a burst does not all pick the worker that
looked idle a second ago. Until a worker has measured anything, conservative priors stand in
(a slow prefill), so early decisions do not over-promise.

The choice: the route whose predicted TTFT meets the latency class's target, and of those the
one with the least cost = TTFT + stall_weight x (stall summed over w's running streams); if
neither meets it, the faster. A local prefill longer than `max_local_prefill_s` is taken only
when remote would miss the target: it would hold up whoever arrives at w in the meantime (the
model cannot see arrivals; bench.goodput run 2 showed it). Plain arithmetic, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.control.load import WorkerLoad
from router.policy import Decision, Route


@dataclass(frozen=True)
class CostModel:
    prior_prefill_tokens_per_s: float = 250.0
    prior_decode_step_s: float = 0.05
    prior_transfer_s_per_token: float = 2e-4
    remote_overhead_s: float = 0.02  # allocate + prefill dispatch + admission on arrival
    # Seconds of TTFT one second of stall on one running stream is worth.
    stall_weight: float = 2.0
    absorbed_tokens: int = 64
    # Longest local prefill (seconds of compute) the model prefers to a remote one that meets
    # the target: about an interactive TTFT target, since it blocks the next arrivals.
    max_local_prefill_s: float = 1.0

    def prefill_rate(self, load: WorkerLoad) -> float:
        return load.prefill_tokens_per_s or self.prior_prefill_tokens_per_s

    def decode_step(self, load: WorkerLoad) -> float:
        return load.decode_step_s or self.prior_decode_step_s


@dataclass(frozen=True)
class Estimate:
    route: Route
    ttft_s: float
    stall_s: float  # summed over the decode worker's running streams
    compute_s: float = 0.0  # the prefill's own compute where it runs

    def cost(self, model: CostModel) -> float:
        return self.ttft_s + model.stall_weight * self.stall_s


def prefill_capacity(loads: Iterable[WorkerLoad], model: CostModel) -> float:
    """Prompt tokens per second the workers can prefill together: each one's measured rate,
    the prior where it has none (admission control starts from this; router.admission)."""
    return sum(model.prefill_rate(load) for load in loads)


def local_estimate(decode: WorkerLoad, uncached: int, model: CostModel, *,
                   inflight_tokens: float = 0.0) -> Estimate:
    rate = model.prefill_rate(decode)
    pending = max(decode.waiting_prompt_tokens or 0.0, inflight_tokens)
    stall = max(0, uncached - model.absorbed_tokens) / rate
    return Estimate(Route.LOCAL, (pending + uncached) / rate + model.decode_step(decode),
                    stall * decode.running, uncached / rate)


def remote_estimate(prefill: WorkerLoad, decode: WorkerLoad, uncached: int, model: CostModel,
                    *, inflight_tokens: float = 0.0) -> Estimate:
    rate = model.prefill_rate(prefill)
    pending = max(prefill.queued_tokens + (prefill.waiting_prompt_tokens or 0.0),
                  inflight_tokens)
    transfer = uncached * (prefill.kv_transfer_s_per_token or model.prior_transfer_s_per_token)
    ttft = ((pending + uncached) / rate + transfer + model.remote_overhead_s
            + model.decode_step(decode))
    return Estimate(Route.REMOTE, ttft, 0.0)


def decide_by_cost(local: Estimate, remote: Estimate | None, uncached: int, target_s: float,
                   model: CostModel) -> tuple[Decision, Estimate]:
    """`remote` is None when no prefill worker is available."""
    if remote is None:
        return Decision(Route.LOCAL, "no_prefill_worker", uncached), local
    meets = [e for e in (local, remote) if e.ttft_s <= target_s]
    if remote in meets and local.compute_s > model.max_local_prefill_s:
        meets = [remote]
    if meets:
        best = min(meets, key=lambda e: e.cost(model))
        reason = f"cost_{best.route.value}"
    else:
        best = min((local, remote), key=lambda e: e.ttft_s)
        reason = "cost_over_target"
    return Decision(best.route, reason, uncached), best
