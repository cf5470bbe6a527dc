"""The cost model's fixed cost of a remote prefill, learned from the stages the router
measures on every remote request.

router.cost predicts a remote candidate's TTFT as the prefill worker's queue and compute (at
its measured rate), the KV transfer (at its measured seconds per token), a fixed
`remote_overhead_s` and one decode step. Every term but the fixed one is measured by the
workers; the fixed one stands for what none of them measures: the allocation on the decode
worker (a call, then a wait for the engine's turn between two steps), dispatching the
Prefill call, the decode worker's admission of the arrived KV and the first token's trip
back. It depends on the deployment (the network; the decode worker's step, which both waits
sit behind): on a 2-core 1P1D cluster with cost placement
(docs/bench/cluster_sim/real_1p1d_cost_s59) the 80-token interactive prompts prefilled
remotely took 250-267 ms to their first token against 194-231 ms for those prefilled
locally, where the fixed 20 ms said the two were nearly even.

The router's stage clock (router.timings.StageClock) measures exactly that part of every
remote request: `decode_allocate_ms` + `handoff_ms` (the remote window less the prefill
worker's own queue, compute and transfer, from its report). `RemoteOverhead` keeps the last
`window` misses of the model's counterpart (`remote_overhead_s` + the decode step it
predicted with), and once it has `min_samples` the router prices remote candidates with
their median added, bounded by +-`limit_s` (`apply`). The median: one allocation that waited
out a long prompt's step must not move a fixed cost. The window forgets: a network that got
slower is learned again within `window` remote requests.

Why not the whole first token's miss: the same model also predicts queues and compute, from
heartbeats up to a second old, and their misses are seconds wide in both directions (a long
prompt's queue at the prefill worker) while the fixed cost is tens of milliseconds. A
first version corrected each route by the median of its whole misses; on the 1P1D sweep
(docs/bench/cost_calibration_s60) it learned -0.22 s (local) and -0.29 s (remote): the
model's queue misses, not its fixed costs.

Plain arithmetic, no I/O or clock; the router (router.router) and the simulator
(bench.sim.cluster) feed it.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque

from router.cost import CostModel


class RemoteOverhead:
    @classmethod
    def of_window(cls, window: int) -> RemoteOverhead | None:
        """The router's learner for `--remote-overhead-window` (0: none), correcting once
        it has 16 samples or the whole window."""
        return cls(window, min_samples=min(16, window)) if window else None

    def __init__(self, window: int = 64, min_samples: int = 16, limit_s: float = 0.5):
        if window < 1 or not 1 <= min_samples <= window or limit_s < 0:
            raise ValueError(f"need 1 <= min_samples ({min_samples}) <= window ({window}) "
                             f"and limit_s ({limit_s}) >= 0")
        self.window, self.min_samples, self.limit_s = window, min_samples, limit_s
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []
        self.offset_s = 0.0  # added to the model's remote_overhead_s (0 until min_samples)
        self._base: CostModel | None = None
        self._model: CostModel | None = None

    @property
    def samples(self) -> int:
        return len(self._recent)

    def observe(self, fixed_s: float, decode_step_s: float, model: CostModel) -> None:
        """One remote request's fixed part as measured (`fixed_s`: allocation + hand-off),
        against what `model` (uncorrected: the configured one) says of it with the decode
        step it predicted (`decode_step_s`)."""
        if len(self._recent) == self.window:
            self._sorted.pop(bisect.bisect_left(self._sorted, self._recent.popleft()))
        miss = fixed_s - (model.remote_overhead_s + decode_step_s)
        self._recent.append(miss)
        bisect.insort(self._sorted, miss)
        n = len(self._sorted)
        if n < self.min_samples:
            return
        mid = self._sorted[n // 2] if n % 2 else (self._sorted[n // 2 - 1]
                                                  + self._sorted[n // 2]) / 2
        self.offset_s = min(self.limit_s, max(-self.limit_s, mid))

    def apply(self, model: CostModel) -> CostModel:
        """`model` with the correction added to its `remote_overhead_s`; the same object while
        the correction moved by less than a millisecond (placement takes it per request)."""
        remote = model.remote_overhead_s + self.offset_s
        cur = self._model
        if (cur is None or model is not self._base
                or abs(cur.remote_overhead_s - remote) >= 1e-3):
            self._base = model
            self._model = cur = dataclasses.replace(model, remote_overhead_s=remote)
        return cur
