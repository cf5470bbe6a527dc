"""What the cost model's first-token predictions miss on each route, learned from the first
tokens the router sees.

router.cost predicts a candidate's TTFT from the workers' measured rates (prefill tokens per
second, the decode step, KV transfer per token) plus fixed terms for what no worker measures:
`remote_overhead_s` (the allocation on the decode worker, the Prefill call, the hand-off)
and `local_overhead_s` (the request's trip to the decode worker and its wait for the step
under way). Those depend on the deployment: the network, the decode worker's step (it takes
an allocation or a hand-off between two steps), the prefill worker's own dispatch. On a 2-core
1P1D cluster with cost placement (docs/bench/cluster_sim/real_1p1d_cost_s59) the 80-token
interactive prompts prefilled remotely took 250-267 ms to their first token against
194-231 ms for the ones prefilled locally, where the fixed 20 ms the model assumed said the
two were nearly even.

`TTFTCalibration` keeps, per route, the last `window` residuals of placements predicted from
measured rates (`measured`): the first token's time after
the placement, as the router measured it, less what the *uncorrected* model predicted (the
prediction less the correction it included, so the correction never feeds on itself). Once a
route has `min_samples`, its correction is their median, bounded by +-`limit_s`, and the
router prices that route's candidates with it (`apply`). The median: a queue the model could
not see (a burst between heartbeats) makes a few residuals seconds long, and they must not
move a fixed cost. The window forgets: a worker that got faster or a network that got slower
is learned again within `window` first tokens of that route.

Plain arithmetic, no I/O or clock; the router (router.router) and the simulator
(bench.sim.cluster) feed it.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque

from pdserve.control.load import WorkerLoad
from router.cost import CostModel
from router.policy import Route


def measured(route: Route, decode: WorkerLoad, prefill: WorkerLoad | None) -> bool:
    """Whether a placement on `route` was predicted from the workers' own measurements (their
    prefill rate, decode step and, remote, KV transfer) rather than the model's priors: only
    those misses are the fixed costs the correction is for. A cluster's first requests are
    predicted from priors that can be off by a factor (a prior prefill rate of 250 tokens/s
    against the 600-1,000 measured on this machine's default model)."""
    if not decode.decode_step_s:
        return False
    if route is Route.LOCAL:
        return bool(decode.prefill_tokens_per_s)
    return (prefill is not None and bool(prefill.prefill_tokens_per_s)
            and bool(prefill.kv_transfer_s_per_token))


class TTFTCalibration:
    def __init__(self, window: int = 64, min_samples: int = 16, limit_s: float = 0.5):
        if window < 1 or not 1 <= min_samples <= window or limit_s < 0:
            raise ValueError(f"need 1 <= min_samples ({min_samples}) <= window ({window}) "
                             f"and limit_s ({limit_s}) >= 0")
        self.window, self.min_samples, self.limit_s = window, min_samples, limit_s
        self._recent = {r: deque[float]() for r in (Route.LOCAL, Route.REMOTE)}
        self._sorted: dict[Route, list[float]] = {r: [] for r in self._recent}
        self._offset = dict.fromkeys(self._recent, 0.0)
        self._base: CostModel | None = None
        self._model: CostModel | None = None

    def offset_s(self, route: Route) -> float:
        """Seconds added to `route`'s predicted TTFT now (0 until `min_samples`)."""
        return self._offset.get(route, 0.0)

    def samples(self, route: Route) -> int:
        return len(self._recent.get(route, ()))

    def uncorrected(self, route: Route, predicted_s: float, used: CostModel) -> float:
        """`predicted_s`, predicted with `used` (what `apply` returned for that placement), as
        the model without corrections would have predicted it."""
        base = self._base
        if base is None or used is base:
            return predicted_s
        if route is Route.LOCAL:
            return predicted_s - (used.local_overhead_s - base.local_overhead_s)
        return predicted_s - (used.remote_overhead_s - base.remote_overhead_s)

    def observe(self, route: Route, predicted_s: float, observed_s: float) -> None:
        """One first token on `route`: `predicted_s` as the uncorrected model predicted it
        (`uncorrected`), `observed_s` from the placement to the first token."""
        recent = self._recent.get(route)
        if recent is None:  # a fallback: neither route's prediction held
            return
        ordered = self._sorted[route]
        if len(recent) == self.window:
            ordered.pop(bisect.bisect_left(ordered, recent.popleft()))
        residual = observed_s - predicted_s
        recent.append(residual)
        bisect.insort(ordered, residual)
        if len(ordered) < self.min_samples:
            return
        n = len(ordered)
        median = (ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2)
        self._offset[route] = min(self.limit_s, max(-self.limit_s, median))

    def apply(self, model: CostModel) -> CostModel:
        """`model` with the corrections added to its fixed terms; the same object while
        neither moved by a millisecond (placement takes it per request)."""
        local = model.local_overhead_s + self._offset[Route.LOCAL]
        remote = model.remote_overhead_s + self._offset[Route.REMOTE]
        cur = self._model
        if (cur is None or model is not self._base
                or abs(cur.local_overhead_s - local) >= 1e-3
                or abs(cur.remote_overhead_s - remote) >= 1e-3):
            self._base = model
            self._model = cur = dataclasses.replace(model, local_overhead_s=local,
                                                    remote_overhead_s=remote)
        return cur
